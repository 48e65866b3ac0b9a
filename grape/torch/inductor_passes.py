"""What grape's Inductor graph passes share: running after a pass already configured, and a
uuid that keeps Inductor's caches from serving a graph compiled otherwise."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["ChainedPass"]


class ChainedPass(CustomGraphPass):
    """An Inductor custom pass (:meth:`apply`) that runs after ``before``, a pass already
    configured in its place (a user's own keeps running). Its uuid names this module's source,
    the source of the module that defines the subclass, :meth:`salt`, and ``before``'s uuid:
    Inductor's caches never serve a graph compiled without the pass, or with an older version
    of it."""

    def __init__(self, before: Any = None) -> None:
        self.before = before

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        self.apply(graph)

    def apply(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def salt(self) -> bytes:
        """What else the pass's output depends on (a module-level setting)."""
        return b""

    def uuid(self) -> Any:
        digest = hashlib.sha256(self.salt())
        for source in (__file__, inspect.getfile(type(self))):
            with open(source, "rb") as f:
                digest.update(f.read())
        if self.before is not None:
            uuid = getattr(self.before, "uuid", lambda: None)()
            if uuid is None:  # (a pass that cannot say what it is: nothing cached)
                return None
            digest.update(str(uuid).encode())
        return digest.hexdigest()
