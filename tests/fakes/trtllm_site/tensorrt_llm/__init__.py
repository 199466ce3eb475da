"""`import tensorrt_llm` as the test double (tests/fakes/trtllm.py) in processes a test starts: a test
puts tests/fakes/trtllm_site (and the repository) on PYTHONPATH, as `double.install` puts the double in
sys.modules within one process. Tests only; nothing of the product knows this package.

Two things only a test several processes away needs, neither of them the double's behaviour:
- TOLLGATE_TEST_TRTLLM_RECORD=<file>: each `generate_async` and each `abort` appends a JSON line (the
  pid, the request's seed, how many requests the LLM holds unfinished), so the test can tell which
  process held the LLM and that every worker's requests were in its one batch.
- TOLLGATE_TEST_TRTLLM_STEP_DELAY=<seconds>: the double's `LLM.step_delay`.
The vocabulary the double's engine generates from is fixed before the LLM hands out its tokenizer, as
a real tokenizer's is: the workers' copies (engines/backends/trtllm_shared.py) then decode the ids it generates.
"""

import json
import os
import sys
from typing import Any

from tests.fakes import trtllm as double

_top, llmapi = double.modules()
sys.modules[__name__ + ".llmapi"] = llmapi
SamplingParams = _top.SamplingParams
_RECORD = os.environ.get("TOLLGATE_TEST_TRTLLM_RECORD")
if os.environ.get("TOLLGATE_TEST_TRTLLM_STEP_DELAY"):
    double.LLM.step_delay = float(os.environ["TOLLGATE_TEST_TRTLLM_STEP_DELAY"])


def _record(event: str, **fields: Any) -> None:
    if _RECORD:
        with open(_RECORD, "a") as out:
            out.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


class LLM(double.LLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer.encode(double.STORY)
        for piece, _ in double.LLM.top_alternatives:
            self.tokenizer.encode(piece)

    def generate_async(self, inputs: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = super().generate_async(inputs, sampling_params, *args, **kwargs)
        seed = getattr(result.sampling_params, "seed", None)
        _record("generate", seed=seed, unfinished=sum(1 for r in self.requests if not r.finished),
                seeds_unfinished=sorted({getattr(r.sampling_params, "seed", None) or 0 for r in self.requests if not r.finished}))
        abort = result.abort

        def recorded_abort() -> None:
            _record("abort", seed=seed)
            abort()

        result.abort = recorded_abort
        return result


_top.LLM = LLM
llmapi.LLM = LLM
sys.modules[__name__].__dict__.update({name: getattr(_top, name) for name in dir(_top) if not name.startswith("__")})
