"""Which data-parallel engine core serves a request: the least loaded, with prefix-cache affinity.

Each core has its own KV cache, so a prompt prefix cached on one core saves nothing on another. The
router remembers, for the first full KV block of each prompt it routed (`affinity_key`: a hash of
its `block_size` token ids), the core it chose, and sends a later prompt starting with the same block
to that core while the core's load is within `affinity_margin` requests of the least-loaded core's;
otherwise (or for a prompt shorter than one block, or one it has not seen) to the least-loaded core;
among equally loaded cores, the next in turn (round robin), so that requests arriving one at a time
still spread over the cores. The load of a core is its requests in flight (waiting + running, as
the API process counts them).

No I/O and no locks: the caller (`tinyvllm.engine.dp_client`) serialises `choose` calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_AFFINITY_MARGIN = 8  # requests; a core this much busier than the least loaded gets no affinity
DEFAULT_MAX_PREFIXES = 1 << 16  # prefixes remembered (least recently routed forgotten first)


class Router:
    """Picks a core per request; see the module docstring.

    Args:
        num_cores: the engine cores, indexed 0 .. num_cores-1.
        block_size: tokens per KV-cache block (the prefix cache's unit).
        affinity_margin: the most requests a remembered core may have beyond the least-loaded one
            and still get a prompt of its prefix; 0: only when it is among the least loaded.
        max_prefixes: how many first blocks the router remembers.
    """

    def __init__(
        self,
        num_cores: int,
        block_size: int,
        affinity_margin: int = DEFAULT_AFFINITY_MARGIN,
        max_prefixes: int = DEFAULT_MAX_PREFIXES,
    ) -> None:
        if num_cores < 1 or block_size < 1 or affinity_margin < 0 or max_prefixes < 1:
            raise ValueError(
                f"Router needs num_cores >= 1, block_size >= 1, affinity_margin >= 0 and max_prefixes >= 1; got "
                f"{num_cores}, {block_size}, {affinity_margin}, {max_prefixes}"
            )
        self.num_cores = num_cores
        self.block_size = block_size
        self.affinity_margin = affinity_margin
        self.max_prefixes = max_prefixes
        self._homes: OrderedDict[int, int] = OrderedDict()  # affinity key -> the core it was sent to
        self._turn = 0  # the core that wins the next tie

    def affinity_key(self, prompt_token_ids: Sequence[int]) -> int | None:
        """A hash of the prompt's first KV block (None when the prompt fills no block: nothing of it
        can be cached)."""
        if len(prompt_token_ids) < self.block_size:
            return None
        return hash(tuple(prompt_token_ids[: self.block_size]))

    def choose(self, loads: Sequence[int], key: int | None = None) -> int:
        """The core for a request whose prompt has affinity `key`, given each core's load."""
        if len(loads) != self.num_cores:
            raise ValueError(f"expected {self.num_cores} loads, got {len(loads)}")
        low = min(loads)
        n = self.num_cores
        least = next(c % n for c in range(self._turn, self._turn + n) if loads[c % n] == low)
        self._turn = (least + 1) % n
        if key is None:
            return least
        home = self._homes.get(key)
        if home is not None and loads[home] <= loads[least] + self.affinity_margin:
            self._homes.move_to_end(key)
            return home
        if home is None:  # an overloaded home keeps the prefix: it still has it cached
            self._homes[key] = least
            if len(self._homes) > self.max_prefixes:
                self._homes.popitem(last=False)
        return least
