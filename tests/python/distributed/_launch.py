"""Runs test bodies on 2 worker processes (gloo, CPU, loopback only); never hangs.

``launch(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the
per-rank results as a list. ``fn`` must be a module-level function of an importable
module (the test file) and its results picklable.

The workers are fresh interpreters (multiprocessing "spawn") that join one gloo process
group on 127.0.0.1, at a port found by binding a socket, with the CPU swap backend on.
Importing torch.distributed and building the first device mesh costs seconds per
process, so the workers are started once per pytest process and serve one job after
another; each job starts from a reset swap engine. A job that raises reports its
traceback; one that does not finish within ``timeout`` seconds (a hang in a collective,
a deadlock, a crashed peer) gets the whole pool killed, and the next job starts a fresh
one. Every failure is an AssertionError that carries the workers' tracebacks.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import itertools
import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 60.0
_START_TIMEOUT_S = 60.0  # spawning, importing torch, joining the process group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world_size, port, jobs, results):
    """Worker main loop: join the group, then run jobs until told to stop (None)."""
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        os.environ["HYPER_PARALLEL_CPU_SWAP"] = "1"
        import torch.distributed as dist

        torch.set_num_threads(1)  # two ranks share two cores
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        from hyper_parallel.core.activation_checkpoint import SwapManager

        manager = SwapManager()
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((-1, "error", rank, traceback.format_exc()))
        return
    results.put((-1, "ok", rank, None))
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            job_id, fn, args = job
            try:
                manager.synchronize()
                manager.reset()
                manager.set_cpu_swap(True, delay_ns_per_byte=0.0)
                manager.set_prefetch_depth(1)
                torch.manual_seed(0)
                value = fn(rank, world_size, *args)
                manager.synchronize()
                results.put((job_id, "ok", rank, value))
            except BaseException:  # noqa: BLE001
                results.put((job_id, "error", rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, self.jobs[r], self.results),
                        daemon=True, name=f"hp-dist-rank{r}")
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._ids = itertools.count()
        self._collect(-1, _START_TIMEOUT_S, "start")

    def _collect(self, job_id: int, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                jid, status, rank, payload = self.results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                for rank, p in enumerate(self.procs):
                    if not p.is_alive() and rank not in values and rank not in errors:
                        errors[rank] = f"worker exited with code {p.exitcode} without a report"
                continue
            if jid != job_id:
                continue  # a late report of an earlier job
            (values if status == "ok" else errors)[rank] = payload
            if status != "ok":
                # The other ranks may now wait in a collective: give them a moment to
                # report their own failure.
                deadline = min(deadline, time.monotonic() + 3.0)
        missing = [r for r in range(self.world_size) if r not in values and r not in errors]
        if errors or missing:
            self.close(kill=True)
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                why = ("after another rank failed" if errors
                       else f"within {timeout:.0f}s")
                parts.append(f"ranks {missing} did not finish the {what} {why}; "
                             "the workers were killed")
            raise AssertionError(f"distributed {what} failed:\n" + "\n".join(parts))
        return [values[r] for r in range(self.world_size)]

    def run(self, fn, args, timeout: float) -> list:
        job_id = next(self._ids)
        for q in self.jobs:
            q.put((job_id, fn, args))
        return self._collect(job_id, timeout, f"job {getattr(fn, '__name__', fn)}")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        global _POOL
        if _POOL is self:
            _POOL = None
        if not kill:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOL: _Pool | None = None


def launch(fn, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Runs ``fn(rank, WORLD_SIZE, *args)`` on every rank; returns the per-rank results.

    Raises:
        AssertionError: with every failing worker's traceback, or when the job does not
            finish within ``timeout`` seconds (the workers are then killed).
    """
    global _POOL
    if _POOL is None or not _POOL.alive():
        if _POOL is not None:
            _POOL.close(kill=True)
        _POOL = _Pool(WORLD_SIZE)
    return _POOL.run(fn, args, timeout)


@atexit.register
def _shutdown() -> None:
    if _POOL is not None:
        _POOL.close()


# ---------------------------------------------------------------------------- test helpers
# Used inside the workers: small models, a training loop, comparisons.

D_MODEL = 16
D_HIDDEN = 32


class MLPBlock(nn.Module):
    """Pre-norm MLP block with a residual: ``up`` (colwise under TP), ``down`` (rowwise)."""

    def __init__(self, d: int = D_MODEL, hidden: int = D_HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, n_layers: int = 3, d: int = D_MODEL, hidden: int = D_HIDDEN) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(d, hidden) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, rows: int = 8, d: int = D_MODEL) -> torch.Tensor:
    """The full batch of a step: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, d, generator=g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def param_name(name: str) -> str:
    """A parameter's name as in the unwrapped model. (A parent's named_parameters() shows
    the wrapper's child, as with torch's own checkpoint wrapper; torch.distributed's
    state-dict helpers strip it the same way.)"""
    return name.replace("_checkpoint_wrapped_module.", "")


def train(model: nn.Module, inputs, lr: float = 0.05):
    """SGD with momentum over ``inputs`` (one per step). Returns per-step losses, per-step
    gradients and the final parameters, by parameter name, as they are (DTensor or not)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, grads = [], []
    for x in inputs:
        loss = loss_of(model(x))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({param_name(n): p.grad.detach().clone()
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {param_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``t`` (a DTensor's local shard)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of ``t`` (gathers a DTensor: a collective, call it on every rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_equal_runs(a, b, what: str) -> None:
    """Bitwise equality of two ``train`` results on this rank (local shards)."""
    losses_a, grads_a, params_a = a
    losses_b, grads_b, params_b = b
    for step, (la, lb) in enumerate(zip(losses_a, losses_b, strict=True)):
        assert torch.equal(local(la), local(lb)), f"{what}: loss of step {step}: {la} != {lb}"
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b, strict=True)):
        assert ga.keys() == gb.keys(), f"{what}: parameter names {ga.keys()} != {gb.keys()}"
        for name in ga:
            a, b = local(ga[name]), local(gb[name])
            assert torch.equal(a, b), \
                f"{what}: grad of {name} at step {step} differs by {(a - b).abs().max()}"
    for name in params_a:
        assert torch.equal(local(params_a[name]), local(params_b[name])), \
            f"{what}: parameter {name} after training differs"


def assert_close_runs(dist_run, ref_run, what: str, loss_scale=None, rtol=1e-5,
                      atol=1e-6) -> None:
    """A distributed ``train`` result against the single-process reference: gathered
    gradients and parameters, and losses (``loss_scale(loss)`` maps a rank's loss to the
    global one, e.g. an all-reduce average for data parallel)."""
    losses_d, grads_d, params_d = dist_run
    losses_r, grads_r, params_r = ref_run
    for step, (ld, lr_) in enumerate(zip(losses_d, losses_r, strict=True)):
        ld = loss_scale(ld) if loss_scale is not None else full(ld)
        torch.testing.assert_close(ld, lr_, rtol=rtol, atol=atol,
                                   msg=lambda m, s=step: f"{what}: loss of step {s}: {m}")
    for step, (gd, gr) in enumerate(zip(grads_d, grads_r, strict=True)):
        assert gd.keys() == gr.keys(), f"{what}: parameter names {gd.keys()} != {gr.keys()}"
        for name in gr:
            torch.testing.assert_close(
                full(gd[name]), gr[name], rtol=rtol, atol=atol,
                msg=lambda m, n=name, s=step: f"{what}: grad of {n} at step {s}: {m}")
    for name in params_r:
        torch.testing.assert_close(full(params_d[name]), params_r[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what}: parameter {n}: {m}")


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def mesh_1d(world_size: int, name: str):
    """A 1-D CPU mesh over the workers, through hyper_parallel's re-export."""
    from hyper_parallel import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=(name,))
