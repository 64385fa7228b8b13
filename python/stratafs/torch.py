"""PyTorch integration: a sampler that tells the cluster which files come next.

A training job's sampler knows the order of the epoch before the first sample is read;
:class:`PrefetchSampler` wraps it and, as the DataLoader draws indices, sends the next
``lookahead`` files of that order to the workers that will serve them
(:meth:`stratafs.StrataFileSystem.prefetch`), which fetch them ahead of the reader. A cold,
shuffled epoch of small files then waits on the store far less: the workers' fetches overlap
instead of each sample paying its own round trip. See docs/PYTHON.md, "Prefetch".

    sampler = PrefetchSampler(RandomSampler(dataset), fs, paths, lookahead=512)
    loader = DataLoader(dataset, sampler=sampler, num_workers=4, batch_size=None)

The sampler runs in the process that iterates the DataLoader (never in its workers), so one
stream of hints covers every worker.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

__all__ = ["PrefetchSampler"]


class PrefetchSampler(Sampler[int]):
    """Yields ``sampler``'s indices, hinting ``paths[i]`` for the next ``lookahead`` of them
    every ``every`` indices (default a quarter of ``lookahead``). ``paths[i]`` is the file
    sample ``i`` reads. The window is cleared when an epoch ends or is abandoned."""

    def __init__(self, sampler, fs, paths: Sequence[str], lookahead: int = 256, every: int | None = None):
        if lookahead < 1:
            raise ValueError(f"lookahead must be at least 1, not {lookahead}")
        self.sampler = sampler
        self.fs = fs
        self.paths = paths
        self.lookahead = lookahead
        self.every = max(1, every or lookahead // 4)
        self.hints_sent = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        order = list(iter(self.sampler))
        stream = int.from_bytes(os.urandom(8), "little") >> 1
        try:
            for i, index in enumerate(order):
                if i % self.every == 0:
                    window = [self.paths[j] for j in order[i:i + self.lookahead]]
                    self.fs.prefetch(window, stream=stream)
                    self.hints_sent += 1
                yield index
        finally:
            self.fs.prefetch([], stream=stream)
