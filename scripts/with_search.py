"""The tinyvllm command line with the top-k radix select off (RADIX in kernels/top_p_sampling/plan.py, on by
default, read there at each call): every truncating row takes the bisection search, for timing the two in
the same session:

    python scripts/with_search.py bench throughput --top-p 0.9 --top-k 50 --name throughput_top_p_search_h200
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyvllm.kernels.top_p_sampling.plan as top_p_plan
from tinyvllm.entrypoints.cli import main

if __name__ == "__main__":
    top_p_plan.RADIX = False
    sys.exit(main(sys.argv[1:]))
