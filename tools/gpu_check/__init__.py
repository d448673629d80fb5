"""The GPU check of issue 26: tandem's in-process path on a device, measured, with no weights from outside.

    python -m tools.gpu_check --out DIR [--device cuda|cpu] [--tiny] [--budget-s 420]

Random-weight Llama targets of real shapes (SmolLM2-135M, Llama-3.2-1B in fp32 and bf16, Llama-3.1-8B
in bf16) and drafts of real shapes (SmolLM2-135M-shaped, the feature-fed draft), built on the device.
Sections (each guarded by the time budget, skipped with the reason when it would not fit):
greedy equality in fp32 (`equality`), the verify-cost curve, the cost ratio c, the loop's overhead
(`costs`), speedups at controlled acceptance against the pipeline model (`speedups`). One JSON,
DIR/gpu_check.json. `--tiny` (automatic on CPU) runs the same code on tiny shapes in seconds and
reports `"verified_on_gpu": false`. `tools/device/README.md` says how to run it on the device machine.
"""
