"""Work on a few threads with results in order: small layers factored side by side."""

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from concurrent.futures import Future


def in_order(fn, items, workers: int):
    """fn(item) for each item, yielded in order, with at most `workers` running at once on
    threads (torch releases the GIL), each torch op on one thread meanwhile; workers=1 runs inline."""
    if workers <= 1:
        yield from map(fn, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            pending: deque[Future] = deque()
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) == workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        torch.set_num_threads(threads)
