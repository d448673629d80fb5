import sys

from tools.gpu_check.check import main

sys.exit(main())
