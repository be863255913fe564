"""An engine whose model "writes" given texts: for a request whose prompt contains `SCRIPT[name]`,
the sampled tokens are replaced by the tokens of `scripts[name]` (then EOS). Everything else (the
scheduler, detokenization, stop rules, the server) runs as usual, so the server's parsing of tool
calls and reasoning is tested on model output that random weights would never produce."""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"SCRIPT\[(\w+)\]")


def scripted_engine(args: Any, scripts: dict[str, str]) -> Any:
    from tinyvllm.core.outputs import ModelRunnerOutput
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    tok = engine.tokenizer
    eos = tok.eos_token_id
    ids = {name: [*tok.encode(text, add_special_tokens=False), eos] for name, text in scripts.items()}
    scheduler = engine.scheduler
    real_update = scheduler.update_from_output

    def script_of(request: Any) -> list[int] | None:
        found = _MARKER.search(tok.decode(list(request.prompt_token_ids), skip_special_tokens=False))
        return ids[found.group(1)] if found else None

    def update(output: Any, runner_output: ModelRunnerOutput) -> Any:
        sampled = list(runner_output.sampled_token_ids)
        k = 0
        for seq in output.sequences:
            if not seq.sample:
                continue
            request = scheduler.requests.get(seq.request_id)
            script = script_of(request) if request is not None else None
            if script is not None:
                sampled[k] = script[min(len(request.output_token_ids), len(script) - 1)]
            k += 1
        runner_output.sampled_token_ids = sampled
        return real_update(output, runner_output)

    scheduler.update_from_output = update
    return engine
