"""The tinyvllm command line with decode attention's default config changed (kernels/decode_attention
DEFAULT_CONFIG, which every decode step takes), for timing a candidate default against today's in the
same session:

    python scripts/with_decode_config.py prefix_stream=1 -- bench throughput --name throughput_prefix_stream_h200

FIELD=VALUE pairs before `--` name DecodeConfig fields (integers; booleans as 0 / 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyvllm.kernels.decode_attention as decode_attention
from tinyvllm.entrypoints.cli import main


def changed(pairs: list[str]) -> decode_attention.DecodeConfig:
    """DEFAULT_CONFIG with each FIELD=VALUE of `pairs` set (the field's type applied to VALUE)."""
    cfg = decode_attention.DEFAULT_CONFIG
    for pair in pairs:
        field, _, value = pair.partition("=")
        if field not in cfg._fields:
            raise SystemExit(f"{field!r} is not a DecodeConfig field: {', '.join(cfg._fields)}")
        kind = type(getattr(cfg, field))
        cfg = cfg._replace(**{field: kind(int(value))})
    return cfg


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit(__doc__)
    cut = args.index("--")
    decode_attention.DEFAULT_CONFIG = changed(args[:cut])
    print(f"decode attention: {decode_attention.DEFAULT_CONFIG}", file=sys.stderr)
    sys.exit(main(args[cut + 1 :]))
