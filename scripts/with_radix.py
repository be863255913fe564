"""The tinyvllm command line with the top-k radix select on (kernels/top_p_sampling.RADIX, off by default
until timed), for timing it against the default in the same session:

    python scripts/with_radix.py bench throughput --top-p 0.9 --top-k 50 --name throughput_top_p_radix_h200
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyvllm.kernels.top_p_sampling as top_p_sampling
from tinyvllm.entrypoints.cli import main

if __name__ == "__main__":
    top_p_sampling.RADIX = True
    sys.exit(main(sys.argv[1:]))
