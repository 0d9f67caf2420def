"""Low-precision copies that are a differentiable, cached function of the user's FP32 tensors.

At O2/O3 amplite's graph reads some weights only in low precision. Instead of holding separate
low-precision leaf parameters (which DDP, ``clip_grad_norm_``, ``requires_grad_`` and
``model.load_state_dict`` never see), every graph reads the user's own parameter and passes it through
:class:`LowCopies` (a ``call_module`` node): the copy is cast once and reused until the parameter
changes (its version counter, storage or shape), and its gradient flows back into the parameter's FP32
``.grad`` through autograd itself. So:

- gradients of several backwards accumulate in FP32 in ``param.grad`` (plain ``loss.backward()`` too);
- DDP's gradient hooks and its initial broadcast act on the parameters the graph actually depends on;
- ``requires_grad_(False)`` freezes a parameter (no gradient reaches it), unfreezing brings them back;
- an in-place change of a parameter (``model.load_state_dict``, an optimizer step, DDP's broadcast)
  makes the next forward recast it: no graph ever runs on a stale copy.

The version counter does not see every change: ``p.data.clamp_()``, an EMA written as
``p.data.mul_(d).add_(q.data, alpha=1 - d)`` or ``p.data = new`` of equal storage edit the values through a
tensor with a version counter of its own. So by default (``every_forward``) :meth:`LowCopies.sync` recasts
every copy at every forward of the net — one fused cast of the weights the graph reads low, what
``torch.autocast`` does per forward anyway — into fresh buffers: after each forward the net drops its
references (:meth:`LowCopies.release`), so a copy lives only through what autograd saved and is freed as
the backward passes its layer, as autocast's casts are. A copy still cached at a sync (read between two
forwards, e.g. by a checkpointed region's recompute) whose master's version/storage/shape changed is
recast as a real change (bumping the copy's version, so a backward still pending on it fails as it would
in FP32), the others in place through ``.data``. ``on_change`` keeps the copies and trusts the version
counters only (cheaper: no cast at a forward whose weights did not change; ``.data`` edits then need
``opt.refresh()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Cast(torch.autograd.Function):
    """``master -> low`` with a cached forward; the backward is the cast of the gradient to FP32."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, low: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = master.dtype
        return low.detach()  # a new alias: autograd gives it its own grad_fn, the cached tensor stays plain

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.dtype), None


class LowCopies(nn.Module):
    """The cache of low-precision copies shared by every graph of one ``TrainingNet``.

    Args:
        dtype: The low-precision dtype.
        every_forward: Recast every copy at each :meth:`sync` (catches ``.data`` edits); else only the
            copies whose master's version counter, storage or shape changed.
    """

    def __init__(self, dtype: torch.dtype, every_forward: bool = True) -> None:
        super().__init__()
        self.dtype = dtype
        self.every_forward = every_forward
        self.syncs = 0  # sync() calls that recast (for reports and tests)
        # id(master) -> (master, low copy or None (before the first forward, after a release), the master's
        # state the copy was made from)
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, torch.Size]]] = {}

    @staticmethod
    def _stamp(t: torch.Tensor) -> tuple[int, int, torch.Size]:
        return (t._version, t.data_ptr(), t.shape)

    def track(self, master: torch.Tensor) -> None:
        """Register ``master`` as read in low precision without casting it yet: the first :meth:`sync` (the
        net's next forward) or :meth:`low_of` casts it. Preparing holds no copy, as autocast holds none before
        its first forward."""
        entry = self._copies.get(id(master))
        if entry is None or entry[0] is not master:
            self._copies[id(master)] = (master, None, self._stamp(master))

    def low_of(self, master: torch.Tensor) -> torch.Tensor:
        """The current low-precision copy of ``master`` (cast now if it changed since the last cast)."""
        entry = self._copies.get(id(master))
        stamp = self._stamp(master)
        if entry is None or entry[0] is not master or entry[1] is None or entry[2] != stamp:
            with torch.no_grad():
                low = master.detach().to(self.dtype)
            self._copies[id(master)] = (master, low, stamp)
            return low
        return entry[1]

    @torch.no_grad()
    def sync(self) -> None:
        """Make every copy the cast of its master's current value (called before a graph runs).

        A master whose stamp changed gets a real recast (new tensor or versioned in-place copy); with
        ``every_forward`` the others are recast in place without a version bump, in one fused copy.
        """
        quiet_dst: list[torch.Tensor] = []
        quiet_src: list[torch.Tensor] = []
        for key, (master, low, stamp) in list(self._copies.items()):
            now = self._stamp(master)
            if low is None:  # released after the last step: a new buffer, filled in the fused copy below
                low = torch.empty_like(master, dtype=self.dtype, memory_format=torch.preserve_format)
                self._copies[key] = (master, low, now)
                quiet_dst.append(low)
                quiet_src.append(master.data)
            elif now != stamp:
                if low.shape == master.shape and low.device == master.device:
                    low.copy_(master)
                else:
                    low = master.detach().to(self.dtype)
                self._copies[key] = (master, low, now)
            elif self.every_forward:
                quiet_dst.append(low.data)
                quiet_src.append(master.data)
        if quiet_dst:
            torch._foreach_copy_(quiet_dst, quiet_src)
            self.syncs += 1

    def forward(self, master: torch.Tensor) -> torch.Tensor:
        """The low copy of ``master``, differentiable back to ``master`` (FP32 gradient).

        Under ``torch.compile`` the cast is traced as a plain ``master.to(dtype)`` (the same value as the
        cached copy, which is always the cast of the current master; the same FP32 gradient): the cache's
        identity checks would break the compiled graph at every weight and recompile per parameter.
        """
        if torch.compiler.is_compiling():
            return master.to(self.dtype)
        low = self.low_of(master)
        if master.requires_grad and torch.is_grad_enabled():
            return _Cast.apply(master, low)
        return low

    @torch.no_grad()
    def refresh(self, round_masters: bool = False) -> None:
        """Recast every copy from its master now (in place); with ``round_masters`` round the masters first."""
        for key, (master, low, _) in list(self._copies.items()):
            if round_masters:
                master.copy_(master.to(self.dtype))
            if low is not None and low.shape == master.shape and low.device == master.device:
                low.copy_(master)
            else:
                low = master.detach().to(self.dtype)
            self._copies[key] = (master, low, self._stamp(master))

    @torch.no_grad()
    def after_step(self, round_masters: bool = False) -> None:
        """After an optimizer step: recast now (``on_change``), or release the copies (``every_forward``).

        With ``every_forward`` the next :meth:`sync` casts every copy anyway, so between the step and the
        next forward they hold no memory: the optimizer step and what runs around it (evaluation aside)
        see the same resident weights as under ``torch.autocast``, whose casts live for one forward and
        backward.
        """
        if not self.every_forward:
            self.refresh(round_masters=round_masters)
            return
        if round_masters:
            for master, _, _ in list(self._copies.values()):
                master.copy_(master.to(self.dtype))
        self.release()

    def release(self) -> None:
        """Drop the cache's references to the copies (``every_forward``: the next :meth:`sync` casts anew).

        Called after each forward of the net: the copies the graph read stay alive only through what autograd
        saved for backward, so they are freed layer by layer as the backward passes them, as autocast's
        per-forward casts are, instead of all living until the optimizer step.
        """
        if not self.every_forward:
            return
        for key, (master, _, stamp) in list(self._copies.items()):
            self._copies[key] = (master, None, stamp)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(low copy, master)`` for every tensor the graphs read in low precision (cast if stale)."""
        return [(self.low_of(master), master) for master, _, _ in list(self._copies.values())]

    def __repr__(self) -> str:
        return f"LowCopies({str(self.dtype).removeprefix('torch.')}, {len(self._copies)} tensors)"


def read_user_tensors(gm: torch.fx.GraphModule, model: nn.Module, copies: LowCopies) -> int:
    """Make ``gm`` read the user's parameters and buffers, through ``copies`` where it wants them low.

    Export hands the graph the user's parameter objects (buffers share their storage); amplite's
    ``store_low_params`` pass replaced those read only in low precision by new low-precision tensors.
    Afterwards every parameter/buffer attribute of ``gm`` that has a user tensor of the same name *is*
    that tensor, and every read of one that was stored low goes through ``copies``.

    Returns:
        How many distinct user tensors the graph reads in low precision.
    """
    user = dict(model.named_parameters(remove_duplicate=False))
    user.update(model.named_buffers(remove_duplicate=False))
    low_names: set[str] = set()
    for store in ("_parameters", "_buffers"):
        for mod_name, mod in list(gm.named_modules(remove_duplicate=False)):
            for attr, t in list(getattr(mod, store).items()):
                name = f"{mod_name}.{attr}" if mod_name else attr
                mine = user.get(name)
                if mine is None or t is None or t is mine:
                    continue
                if t.dtype != mine.dtype:
                    low_names.add(name)
                del getattr(mod, store)[attr]
                (mod._parameters if isinstance(mine, nn.Parameter) else mod._buffers)[attr] = mine
    for n in low_names:
        copies.track(user[n])  # cast at the first forward (preparing holds no copy)
    if not low_names:
        return 0
    if not hasattr(gm, "amplite_low_copies"):
        gm.add_module("amplite_low_copies", copies)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in low_names:
            with graph.inserting_after(node):
                cast = graph.call_module("amplite_low_copies", (node,))
            node.replace_all_uses_with(cast, delete_user_cb=lambda user_node, c=cast: user_node is not c)
    graph.lint()
    gm.recompile()
    return len({id(user[n]) for n in low_names})
