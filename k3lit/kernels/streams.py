"""Where a kernel's small side tables (chunk indices, address lists) may be kept between calls.

Eager training runs on the device's default stream and reuses the same shapes and addresses every step, so the
KDA and AttnRes launchers keep their tables. Under CUDA graphs that is wrong in two ways: a table made during a
graph's warm-up (a side stream) lives in the graph's memory pool, which must hold no tensor beyond the graph's
outputs, and one made during the capture holds its values only when the graph replays. Off the default stream the
tables are therefore built afresh each call.
"""

from __future__ import annotations

import torch


def cacheable(device: torch.device) -> bool:
    """Whether a table made now on ``device`` may be kept for later calls: on the CPU always; on CUDA only on the
    device's default stream outside a graph capture (the stream eager training runs on, so every later call is
    ordered after the table's building)."""
    if device.type != "cuda":
        return True
    return (not torch.cuda.is_current_stream_capturing()
            and torch.cuda.current_stream(device) == torch.cuda.default_stream(device))
