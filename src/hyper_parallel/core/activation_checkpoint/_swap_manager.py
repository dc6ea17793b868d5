"""SwapManager: the process-wide face of the C++ swap engine (SPEC 2, 3, 6)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import weakref

import torch

from hyper_parallel._extension import _C

from ._backends import backend_for, loaded_backends
from ._errors import ArgumentKindError
from ._region import REGISTERED_ONLY, Region, in_backward
from ._warnings import warn as warn_user

_LAYER_ATTR = "_hyper_parallel_layer"


# Every live node (for reset()).
_nodes: weakref.WeakSet = weakref.WeakSet()

# Per thread: node id -> stack of the regions its forward hooks opened (None when the hook
# opened none). Thread-local because two threads may run the same model (SPEC 4.10).
_tls = threading.local()



#: The largest prefetch depth and offload window the engine takes (csrc/bindings/BindSwap.cpp
#: checks the same): plans and options are validated against it before anything changes.
MAX_ENGINE_SETTING = 1 << 20

class _Stacks(dict):
    """One thread's region stacks (a dict subclass, so ``reset()`` can reach every thread's
    through weak references)."""

    __slots__ = ("__weakref__",)
    __hash__ = object.__hash__  # identity: a WeakSet member


_all_stacks: weakref.WeakSet = weakref.WeakSet()


def _region_stack(node) -> list:
    stacks = _tls.__dict__.get("stacks")
    if stacks is None:
        stacks = _tls.__dict__["stacks"] = _Stacks()
        _all_stacks.add(stacks)
    return stacks.setdefault(id(node), [])


def _close_stale(stack: list) -> None:
    """Aborts regions a layer's hooks opened in an earlier forward that never reached its
    forward hooks (a KeyboardInterrupt is no ``Exception``, so torch runs no always-call
    hook for it)."""
    while stack:
        region = stack.pop()
        if region is not None:
            region.__exit__(RuntimeError, None, None)


class _LayerNode:
    """A layer's identity in the engine's schedule, stored on the module or function.

    Deep-copying a module deep-copies its node: the copy gets a new engine layer id and
    the links of the copied chain, so a copied model has its own schedule (SPEC 4.5).
    """

    def __init__(self, name: str) -> None:
        self._take_layer_id()
        self.name = name
        self.prev: _LayerNode | None = None
        self.next: _LayerNode | None = None

    def _take_layer_id(self) -> None:
        # A fresh engine layer id, given back to the engine when the node dies (a dropped
        # deep copy, a deleted model), so the schedule does not grow with dead layers.
        self.layer_id = _C.new_layer()
        weakref.finalize(self, _C.remove_layer, self.layer_id)
        _nodes.add(self)

    def __deepcopy__(self, memo):
        new = _LayerNode.__new__(_LayerNode)
        memo[id(self)] = new
        new._take_layer_id()
        new.name = self.name
        new.prev = copy.deepcopy(self.prev, memo) if self.prev is not None else None
        new.next = copy.deepcopy(self.next, memo) if self.next is not None else None
        if new.prev is not None:
            _C.link_layers(new.prev.layer_id, new.layer_id)
        if new.next is not None:
            _C.link_layers(new.layer_id, new.next.layer_id)
        return new

    # Pickling (torch.save of a model with a chain): engine layer ids belong to one
    # process, so a loaded node takes a fresh id and relinks to whichever neighbours are
    # already restored (the later one of each pair makes the link).
    def __getstate__(self):
        return {"name": self.name, "prev": self.prev, "next": self.next}

    def __setstate__(self, state):
        self._take_layer_id()
        self.name = state["name"]
        self.prev, self.next = state["prev"], state["next"]
        if self.prev is not None and "layer_id" in self.prev.__dict__:
            _C.link_layers(self.prev.layer_id, self.layer_id)
        if self.next is not None and "layer_id" in self.next.__dict__:
            _C.link_layers(self.layer_id, self.next.layer_id)

    # Forward hooks for plain modules (not our wrappers) that take part in a schedule:
    # the module's forward becomes a region in which swap_tensor_wrapper registrations
    # are honoured. When the forward already runs inside this layer's invocation (a
    # swap()/checkpoint()/wrapper region of the same layer) or inside a recompute, the
    # hooks open nothing: one invocation is one region.
    #
    # A region this node's hooks opened is on its stack only while the module's forward
    # runs, so one still there when the next forward of the module starts was left by an
    # interrupted forward (KeyboardInterrupt skips always-call hooks) and is aborted first.
    # (A module calling itself inside its own forward would have its outer region aborted
    # here: it keeps its activations on device, still correct.)
    def pre_hook(self, module, args):
        stack = _region_stack(self)
        _close_stale(stack)
        current = _C.current_group()
        if in_backward() or (current is not None and current.layer == self.layer_id):
            stack.append(None)
            return
        region = Region(self.layer_id, self.name, REGISTERED_ONLY)
        stack.append(region)  # before entry: an interrupt after it still finds the region
        region.__enter__()

    def post_hook(self, module, args, output):
        stack = _region_stack(self)
        region = stack.pop() if stack else None
        if region is not None:
            region.__exit__(None, None, None)
            region.attach_backward(output)
        return None

    def post_hook_always(self, module, args, output=None):
        # Registered with always_call=True: runs on exceptions too. The normal path is
        # handled by post_hook; here only a region left open by an exception is aborted.
        stack = _region_stack(self)
        if stack and output is None:
            region = stack.pop()
            if region is not None:
                region.__exit__(RuntimeError, None, None)


def _node_hooks(module, node):
    """(hook dict, key) of every forward hook of ``module`` bound to ``node`` (found by
    scanning, so hooks that deepcopy re-bound to a copied node are found too)."""
    found = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in hooks.items():
            if getattr(hook, "__self__", None) is node:
                found.append((hooks, key))
    return found


def layer_node(obj, create: bool = False) -> _LayerNode | None:
    """The schedule node of a module, wrapper or function (created on request)."""
    node = getattr(obj, _LAYER_ATTR, None) if not isinstance(obj, torch.nn.Module) else \
        obj.__dict__.get(_LAYER_ATTR)
    if node is None and isinstance(obj, torch.nn.Module):
        inner = getattr(obj, "_hp_wrapped", None)
        if inner is not None:
            node = layer_node(inner)
    if node is None and create:
        name = type(obj).__name__ if isinstance(obj, torch.nn.Module) else getattr(
            obj, "__qualname__", repr(obj))
        node = _LayerNode(f"{name}#{_C.new_layer()}")
        if isinstance(obj, torch.nn.Module):
            obj.__dict__[_LAYER_ATTR] = node
        else:
            try:
                setattr(obj, _LAYER_ATTR, node)
            except (AttributeError, TypeError) as err:
                raise TypeError(
                    f"hyper_parallel: cannot register {obj!r} as a swap layer: it does not "
                    "accept attributes (bound methods, builtins). Register the nn.Module or "
                    "a plain Python function instead.") from err
    return node


def _through_compile(obj):
    """The activation wrapper inside ``torch.compile(wrapper)`` (torch's OptimizedModule),
    else ``obj``. The wrapper opens its own regions (inside the compiled code), so its
    schedule node must be on it: a chain declared over the compiled modules as they sit in
    the model would otherwise link the OptimizedModule, whose node the wrapper never reads.
    Other compiled modules stay as they are (their forward hooks open the regions, around
    the compiled call)."""
    inner = (obj.__dict__.get("_modules", {}).get("_orig_mod")
             if isinstance(obj, torch.nn.Module) else None)
    if (isinstance(inner, torch.nn.Module) and type(obj).__name__ == "OptimizedModule"
            and "_checkpoint_wrapped_module" in inner.__dict__.get("_modules", {})):
        return inner
    return obj


def _delay_value(value, what: str) -> float:
    """A CPU-swap delay in nanoseconds per byte, validated at the boundary."""
    try:
        delay = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"hyper_parallel: {what}={value!r} is not a number; give the CPU "
                         "swap delay in nanoseconds per byte, e.g. 0.5") from None
    if not math.isfinite(delay) or not 0.0 <= delay <= 1e9:
        raise ValueError(f"hyper_parallel: {what}={value!r} is out of range; the CPU swap delay "
                         "must be a finite number of nanoseconds per byte in [0, 1e9]")
    return delay


class SwapManager:
    """Process-wide swap schedule and statistics (a singleton: ``SwapManager()`` always
    returns the same object).

    Thread-safety: every method may be called from several threads; the state lives in
    the C++ engine behind one lock.
    """

    _instance: SwapManager | None = None
    _lock = threading.Lock()

    def __new__(cls):
        inst = cls._instance
        if inst is not None:  # the hot path of every region: no lock once it exists
            return inst
        with cls._lock:
            if cls._instance is None:
                inst = super().__new__(cls)
                flag = os.environ.get("HYPER_PARALLEL_CPU_SWAP", "").strip().lower()
                if flag in ("1", "true", "yes", "on"):
                    _C.set_cpu_swap(True)
                elif flag not in ("", "0", "false", "no", "off"):
                    raise ValueError(f"hyper_parallel: HYPER_PARALLEL_CPU_SWAP={flag!r} is not "
                                     "a boolean; use 1 (on) or 0 (off)")
                delay = os.environ.get("HYPER_PARALLEL_CPU_SWAP_DELAY_NS_PER_BYTE")
                if delay:
                    _C.set_cpu_delay_ns_per_byte(_delay_value(
                        delay, "HYPER_PARALLEL_CPU_SWAP_DELAY_NS_PER_BYTE"))
                cls._instance = inst
            return cls._instance

    # ------------------------------------------------------------------ schedule
    def set_forward_prefetch_layer(self, first, second) -> None:
        """Declares that ``second`` runs after ``first`` in forward (not necessarily
        adjacent). Over ``layers[i], layers[i+1]`` it builds a chain: layer ``i``'s
        activations are offloaded while layer ``i+1`` runs forward, and prefetched while
        layer ``i+1`` runs backward.

        Args:
            first, second: ``nn.Module`` s (wrapped or not) or plain functions, or
                ``mindspore.nn.Cell`` s (wrapped or not).

        Raises:
            ValueError: when ``first is second``, or when the link would close a cycle
                (``first`` already runs after ``second``).
        """
        first, second = _through_compile(first), _through_compile(second)
        if first is second:
            raise ValueError("hyper_parallel: set_forward_prefetch_layer(a, b) needs two "
                             "different layers; got the same object twice")
        for obj in (first, second):
            if not (isinstance(obj, torch.nn.Module) or callable(obj)):
                raise TypeError(
                    "hyper_parallel: set_forward_prefetch_layer expects nn.Module layers (as "
                    f"in model.layers[i], model.layers[i + 1]) or functions, got {obj!r}")
        backend = backend_for(first, second)  # MindSpore Cells (docs/design.md, "Backends")
        wrapped = backend.wraps_each_other(first, second) if backend is not None else (
                   isinstance(first, torch.nn.Module) and first.__dict__.get("_modules", {})
                   .get("_checkpoint_wrapped_module") is second) or (
                   isinstance(second, torch.nn.Module) and second.__dict__.get("_modules", {})
                   .get("_checkpoint_wrapped_module") is first)
        a = None if wrapped else layer_node(first, create=True)
        b = None if wrapped else layer_node(second, create=True)
        if wrapped or a is b:
            raise ValueError("hyper_parallel: set_forward_prefetch_layer(a, b) got a wrapper and "
                             "the module it wraps; register the wrapped layers (model.layers[i]) "
                             "only")
        _C.link_layers(a.layer_id, b.layer_id)  # refuses a cycle before anything changes
        for old, new, what in ((a.next, b, "successor"), (b.prev, a, "predecessor")):
            if old is not None and old is not new:
                warn_user(f"hyper_parallel: set_forward_prefetch_layer replaces the {what} "
                              f"of layer '{(a if what == 'successor' else b).name}' (a layer has "
                              "one predecessor and one successor in the chain)")
        a.next, b.prev = b, a
        install = backend.install_layer_hooks if backend is not None else \
            self._install_module_hooks
        for obj, node in ((first, a), (second, b)):
            install(obj, node)

    def unregister(self, model) -> None:
        """Removes ``model`` and all its submodules (or one function) from the schedule; one
        never registered is left as it is.

        Raises:
            ArgumentKindError: (a TypeError and a ValueError) when ``model`` is neither a
                module nor a callable (a layer's name, None, a tensor).
        """
        backend = backend_for(model)
        if backend is not None:  # a MindSpore Cell: its sub-Cells and their hooks
            objs = backend.cells_of(model)
            for obj in objs:
                backend.remove_layer_hooks(obj)
        elif isinstance(model, torch.nn.Module):
            objs = list(model.modules())
        elif callable(model) and not isinstance(model, torch.Tensor):
            objs = [model]
        else:
            raise ArgumentKindError(
                f"hyper_parallel: SwapManager().unregister takes the module (or function) "
                f"that was registered, not a {type(model).__name__} ({model!r:.60}); pass "
                f"the module itself, e.g. model.get_submodule(name).")
        self._unregister_objs(objs)

    def unregister_forward_prefetch_layer(self, module) -> None:
        """Removes one layer (a module, wrapper or function given to
        ``set_forward_prefetch_layer``) from the chain, with its hooks; its neighbours are
        no longer linked through it (link them again if the chain should stay whole).
        Submodules keep their own registrations (see :meth:`unregister`)."""
        module = _through_compile(module)
        inner = getattr(module, "_hp_wrapped", None)
        self._unregister_objs([module] + ([inner] if inner is not None else []))

    def unregister_forward_prefetch_hooks(self, module) -> None:
        """Removes the schedule hooks (and chain links) of ``module`` and every submodule;
        the reference's name for :meth:`unregister`, which is the documented one."""
        self.unregister(module)

    def _unregister_objs(self, objs) -> None:
        for obj in objs:
            node = (obj.__dict__.pop(_LAYER_ATTR, None) if isinstance(obj, torch.nn.Module)
                    else getattr(obj, _LAYER_ATTR, None))
            if node is None:
                continue
            if isinstance(obj, torch.nn.Module):
                for hooks, key in _node_hooks(obj, node):
                    del hooks[key]
                    obj._forward_hooks_always_called.pop(key, None)
            _C.remove_layer(node.layer_id)
            if node.prev is not None and node.prev.next is node:
                node.prev.next = None
            if node.next is not None and node.next.prev is node:
                node.next.prev = None
            if not isinstance(obj, torch.nn.Module):
                with contextlib.suppress(AttributeError):
                    delattr(obj, _LAYER_ATTR)

    def _install_module_hooks(self, obj, node: _LayerNode) -> None:
        if not isinstance(obj, torch.nn.Module) or getattr(obj, "_hp_is_wrapper", False):
            return  # our wrappers open their own region; functions are wrapped by swap()
        if _node_hooks(obj, node):
            return  # already installed (also after a deepcopy)
        obj.register_forward_pre_hook(node.pre_hook)
        obj.register_forward_hook(node.post_hook)
        obj.register_forward_hook(node.post_hook_always, always_call=True)

    def set_prefetch_depth(self, depth: int) -> None:
        """How many earlier layers a layer's backward start prefetches (default 1). With 0,
        each layer's activations are reloaded only when its own backward starts (no
        overlap with the later layer's backward).

        Raises:
            ValueError: for a negative or non-integer depth.
        """
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_ENGINE_SETTING:
            raise ValueError("hyper_parallel: prefetch depth must be an int in [0, 2**20] "
                             f"(layers reloaded ahead), got {depth!r}")
        _C.set_prefetch_depth(depth)

    def get_prefetch_depth(self) -> int:
        return int(_C.prefetch_depth())

    def set_group_swap_threshold(self, nbytes: int) -> None:
        """group_swap bucket size limit in bytes (default 32 MiB).

        Raises:
            ValueError: unless ``nbytes`` is an int in [1, 2**62].
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= 1 << 62:
            raise ValueError("hyper_parallel: the group_swap threshold must be an int number of "
                             f"bytes in [1, 2**62], got {nbytes!r}")
        _C.set_fusion_threshold(nbytes)

    def set_cpu_swap(self, enabled: bool, delay_ns_per_byte: float | None = None) -> None:
        """Makes host tensors swappable through the worker-thread copy backend (tests and
        demos on machines without an accelerator); same as ``HYPER_PARALLEL_CPU_SWAP=1``.
        ``delay_ns_per_byte`` adds an artificial copy delay (nanoseconds per byte, applied
        before each copy so that a missing wait reads bytes not copied yet).

        Raises:
            ValueError: for a non-bool ``enabled`` or a delay that is not a finite number in
                [0, 1e9].
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"hyper_parallel: set_cpu_swap(enabled) expects a bool, got {enabled!r}")
        delay = None if delay_ns_per_byte is None else _delay_value(delay_ns_per_byte,
                                                                    "delay_ns_per_byte")
        _C.set_cpu_swap(enabled)
        if delay is not None:
            _C.set_cpu_delay_ns_per_byte(delay)

    def cpu_swap_enabled(self) -> bool:
        return bool(_C.cpu_swap())

    # ------------------------------------------------------------------ groups
    def get_current_group_name(self) -> str | None:
        """Name of the swap group of the innermost running region on this thread."""
        group = _C.current_group()
        return None if group is None else group.name

    def set_current_group_name(self, name: str) -> None:
        """Renames the current group (so launch_*/wait_* can address it).

        Raises:
            RuntimeError: outside any region or group_context.
        """
        _check_group_name("set_current_group_name", name)
        group = _C.current_group()
        if group is None:
            raise RuntimeError("hyper_parallel: set_current_group_name() called outside a swap "
                               "region; use it inside a swap/checkpoint region or "
                               "SwapManager().group_context(name)")
        group.name = str(name)
        _C.name_group(group)

    def group_context(self, name: str):
        """A manual swap group: tensors registered inside (``swap_tensor_wrapper``, or
        saved while ``swap`` hooks are active) stay on device until you call
        ``launch_offload(name)``; bring them back with ``launch_load``/``wait_load``.

        Raises:
            ArgumentKindError: (a TypeError and a ValueError) when ``name`` is not a str,
                at this call.
        """
        _check_group_name("group_context", name)
        return self._group_context(name)

    @contextlib.contextmanager
    def _group_context(self, name: str):
        region = Region(-1, name, REGISTERED_ONLY, manual=True)
        with region:
            yield region.group

    # Unknown names raise SwapGroupError (a RuntimeError, as the reference raises, and a
    # ValueError, as our earlier releases raised). A name that existed but whose group
    # died (every tensor it held is gone) is a no-op: there is nothing left to move.
    #
    # copy_stream: accepted for the reference's call shape and checked to be a stream,
    # but the engine always copies on its own side stream per device (its events and
    # record-stream bookkeeping assume it; SPEC 5). Ordering against a stream of yours
    # is already given: copies start after an event on the current stream, and wait_*
    # order the current stream after them.
    def launch_offload(self, group: str, copy_stream=None) -> None:
        """Starts the D2H copies of group ``group`` and releases its device memory.

        Raises:
            SwapGroupError: for a name never used (or forgotten by :meth:`abort_group`).
            ArgumentKindError: for a ``group`` that is not a str (every group method).
            TypeError: for a ``copy_stream`` that is not a stream.
        """
        _check_stream(copy_stream)
        _by_name("launch_offload", _C.launch_offload, group)

    def wait_offload(self, group: str) -> None:
        """Blocks until the D2H copies of ``group`` are complete (SwapGroupError for an
        unknown name, or for a live group whose offload was never launched)."""
        _by_name("wait_offload", _C.wait_offload, group)

    def launch_load(self, group: str, copy_stream=None) -> None:
        """Re-allocates ``group``'s storages and starts their H2D copies (SwapGroupError
        for an unknown name; ``copy_stream`` as in :meth:`launch_offload`)."""
        _check_stream(copy_stream)
        _by_name("launch_load", _C.launch_load, group)

    def wait_load(self, group: str) -> None:
        """Orders the compute stream after ``group``'s H2D copies (SwapGroupError for an
        unknown name, or for a live group whose load was never launched and whose backward
        has not begun)."""
        _by_name("wait_load", _C.wait_load, group)

    def ensure_group(self, name: str):
        """The live swap group named ``name``, created (an empty manual group, as
        :meth:`group_context` makes) when there is none; returns it. For the reference's
        call shape; prefer :meth:`group_context`, which also makes the group current so
        that ``swap_tensor_wrapper`` registers into it. ArgumentKindError for a ``name``
        that is not a str."""
        _check_group_name("ensure_group", name)
        group = _C.find_group(name)
        if group is None:
            with self.group_context(name) as group:
                pass
        return group

    def abort_group(self, name: str) -> None:
        """Gives up a manual group: whatever it offloaded comes back to the device (data
        is never lost), and the name is forgotten, so later launch/wait calls with it
        raise until it is created again. For a step abandoned half-way.

        Raises:
            SwapGroupError: for a name never used.
        """
        _check_group_name("abort_group", name)
        if _C.find_group(name) is not None:
            _by_name("abort_group", _C.launch_load, name)
            _by_name("abort_group", _C.wait_load, name)
        elif not _C.knows_group(name):
            _raise_unknown(name)
        _C.forget_group(name)

    def release_group_storage(self, name: str) -> None:
        """Drops the manager's hold on group ``name`` once its backward is done (the
        reference calls it at the end of each layer's backward for groups that never went
        through a load). Here a group already lives only as long as the saved tensors
        that need it, so this only forgets a manual group kept alive by its name; the
        tensors are not touched. Unknown names are ignored, as in the reference. Not
        needed with hyper_parallel's own schedule; :meth:`abort_group` is the call that
        gives a manual group up. ArgumentKindError for a ``name`` that is not a str."""
        _check_group_name("release_group_storage", name)
        _C.forget_group(name)

    def active_group_count(self) -> int:
        """How many named swap groups are alive: held by saved tensors that still need
        them, or manual groups (``group_context``) that were neither offloaded nor
        released, which the engine keeps by name for a later ``launch_offload`` even
        once their graph is gone. 0 after a finished step whose manual groups were
        offloaded or released with :meth:`release_group_storage` (a leak check)."""
        return int(_C.live_group_count())

    def is_last_group(self, name: str | None = None) -> bool:
        """Whether group ``name`` (default: the current group) is the invocation of the
        last layer of its prefetch chain (whose activations stay on device). ``False``
        for unknown names and groups in no chain (ArgumentKindError for a name that is
        neither a str nor None)."""
        if name is not None:
            _check_group_name("is_last_group", name)
        group = _C.current_group() if name is None else _C.find_group(name)
        if group is None or group.layer < 0:
            return False
        for node in list(_nodes):
            if node.layer_id == group.layer:
                return node.next is None and node.prev is not None
        return False

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Counters of SPEC 6 (bytes, counts, seconds), summed over the torch engine and
        every framework backend in use (docs/design.md, "Backends"). They count every step
        the engine ran since the last reset, the planner's own (profiling,
        ``measure_plan``) included: the counters are process-wide, so what one thread ran
        cannot be told from another's; call :meth:`reset_stats` after planning to count
        from there."""
        out = dict(_C.stats())
        for backend in loaded_backends():
            for key, value in backend.stats().items():
                out[key] = out.get(key, 0) + value
        return out

    def reset(self) -> None:
        """Clears the counters and all schedule state: layer links included, so register
        the chain again (``set_forward_prefetch_layer``) before the next step. To clear only
        the counters, use :meth:`reset_stats`."""
        _C.reset(True)  # also ends, on every thread, regions an interrupted step left open
        _C.pop_stale_hooks()  # and their saved-tensor hooks on this thread
        for stacks in list(_all_stacks):
            stacks.clear()
        for backend in loaded_backends():
            backend.reset(schedule=True)
        for node in list(_nodes):
            node.prev = node.next = None

    def reset_stats(self) -> None:
        """Clears the counters of :meth:`stats` and keeps the schedule."""
        _C.reset(False)
        for backend in loaded_backends():
            backend.reset(schedule=False)

    def synchronize(self) -> None:
        """Waits for every queued copy of the CPU backend (tests)."""
        _C.synchronize()


class SwapGroupError(RuntimeError, ValueError):
    """No swap group has this name (``launch_offload``, ``wait_load``, ...), or a wait
    comes before its launch (``wait_offload`` before ``launch_offload``, ``wait_load``
    before ``launch_load``)."""


def _raise_unknown(name: str):
    raise SwapGroupError(
        f"hyper_parallel: no live swap group named '{name}'. Create it with "
        "SwapManager().group_context(name) or ensure_group(name) (or check "
        "get_current_group_name()) before launching its offload or load.")


def _check_group_name(api: str, name) -> None:
    if not isinstance(name, str):
        raise ArgumentKindError(
            f"hyper_parallel: {api}'s name must be a str (the name launch_offload/launch_load/"
            f"wait_load address the group by); got {name!r} ({type(name).__name__}).")


def _by_name(api: str, fn, name) -> None:
    _check_group_name(api, name)
    try:
        fn(name)
    except ValueError as err:
        if "no live swap group" in str(err) or "') before launch_" in str(err):
            raise SwapGroupError(str(err)) from None
        raise


def _check_stream(stream) -> None:
    if stream is not None and not isinstance(stream, torch.Stream) and not hasattr(
            stream, "wait_event"):
        raise TypeError("hyper_parallel: copy_stream must be a torch stream or None; got "
                        f"{type(stream).__name__}")


def _after_fork_in_child() -> None:
    # The C++ engine handles its own threads (SwapEngine.h, "fork"); here the Python lock
    # that another thread may have held at the fork is replaced.
    SwapManager._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
