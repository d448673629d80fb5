"""The worker extension: mixed into vLLM's worker (`worker_extension_cls=WORKER_EXTENSION`), so that
`collective_rpc` reaches these methods on every rank. The engine and the Serve replica call
`tandem_apply_fixes` once vLLM has started, then `tandem_configure` to point the proposer at
its drafter (vLLM's eagle3 method: `tandem_eagle_matches` to add tandem's matches to its drafts)."""

from __future__ import annotations

import os

from cluster.vllm.patch import fix_cpu_generators, fix_eagle_seq_lens, fix_rejection_sampler, fix_state
from cluster.vllm.proposer import PROPOSER_CLASS, TandemProposer
from cluster.vllm.protocol import DrafterSpec, InlineMatches


class TandemWorkerExtension:
    """Mixed into vLLM's worker: `collective_rpc` reaches these on every rank."""

    def _tandem_proposer(self) -> TandemProposer:
        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, TandemProposer):
            raise RuntimeError(f"the engine's proposer is {type(drafter).__name__}, not {PROPOSER_CLASS}")
        return drafter

    def tandem_configure(self, spec: dict) -> dict:
        """Point this rank's proposer at the drafter of `spec` (a `DrafterSpec.wire()` dict)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        proposer = self._tandem_proposer()
        proposer.configure(DrafterSpec.model_validate(spec), self.model_runner, get_tensor_model_parallel_rank())
        return {"rank": proposer.rank, "drafter": proposer.client.name if proposer.client else "none"}

    def tandem_eagle_matches(self, matches: dict, gamma: int, schedule: list | None) -> dict:
        """tandem's priced matches inside this rank's vLLM EAGLE-3 proposer (`cluster.vllm.eagle_matches`):
        EAGLE-3 drafts `gamma` tokens (by batch size with `schedule`), a row whose match is expected to go further
        gets the match."""
        from cluster.vllm.eagle_matches import EagleMatches

        EagleMatches(self.model_runner, InlineMatches.model_validate(matches), gamma, schedule).install()
        return {"installed": True}

    def tandem_stats(self) -> dict:
        matches = getattr(self.model_runner, "_tandem_eagle_matches", None)
        return matches.snapshot() if matches is not None else self._tandem_proposer().snapshot()

    def tandem_apply_fixes(self) -> dict:
        """Apply the guarded fixes in this worker (`cluster.vllm.patch`; each a no-op where it is not needed or
        already applied); their state."""
        fix_rejection_sampler()
        fix_cpu_generators()  # seeded requests' partial prefills (before any request)
        fix_eagle_seq_lens()  # the EAGLE drafter's sequence lengths without the padded batch (before any request)
        return fix_state()

    def tandem_fix_state(self) -> dict:
        return fix_state()

    def tandem_pid(self) -> int:
        return os.getpid()

    def tandem_openmp(self) -> dict:
        """The OpenMP runtimes mapped into this worker (`cluster.vllm.openmp`) and the LD_PRELOAD it started with."""
        with open("/proc/self/maps") as maps:
            mapped = {os.path.basename(line.split()[-1]) for line in maps if ".so" in line}
        return {"ld_preload": os.environ.get("LD_PRELOAD", ""),
                "runtimes": sorted(name for name in mapped if name.startswith(("libiomp", "libgomp", "libomp")))}


WORKER_EXTENSION = f"{TandemWorkerExtension.__module__}.{TandemWorkerExtension.__qualname__}"
