"""The saved-activation meter (_memory.py, SavedBytesMeter.h): a storage freed between two
forwards leaves the total before the next forward's saves are added.

Before: the meter added each new storage to a running total and recounted only at region
boundaries, so with no wrapper applied (no boundaries) a step of two gradient-accumulation
micro-batches read both micro-batches' saves at once, twice the real peak (new-user tester,
session 24: "none" read 7.3 MB where one micro-batch held 3.7 MB, and the planner's
fractional budgets were computed from it).
"""

import gc

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    checkpoint_wrapper, saved_activation_memory, swap_wrapper)


def _model(wrap=None):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)]
    if wrap is not None:
        layers = [wrap(layer) for layer in layers]
    return nn.Sequential(*layers)


def _micro_batches(model, n):
    torch.manual_seed(1)
    for _ in range(n):
        model(torch.randn(16, 32)).sum().backward()


@pytest.mark.parametrize("wrap", [None, checkpoint_wrapper], ids=["none", "checkpoint"])
def test_micro_batches_count_one_at_a_time(wrap):
    model = _model(wrap)
    with saved_activation_memory() as one:
        _micro_batches(model, 1)
    with saved_activation_memory() as four:
        _micro_batches(model, 4)
    assert one.peak_bytes > 0
    assert four.peak_bytes == one.peak_bytes


@pytest.mark.filterwarnings("ignore:hyper_parallel. swap region:UserWarning")
def test_micro_batches_under_swap_count_one_at_a_time(cpu_swap, dev):
    model = _model(swap_wrapper).to(dev)
    x = torch.randn(16, 32, device=dev)
    with saved_activation_memory() as one:
        model(x).sum().backward()
    with saved_activation_memory() as three:
        for _ in range(3):
            model(x).sum().backward()
    assert three.peak_bytes == one.peak_bytes


def test_a_dropped_graph_leaves_the_total_before_the_next_forward():
    model = _model()
    x = torch.randn(16, 32)
    with saved_activation_memory() as one:
        model(x).sum().backward()
    with saved_activation_memory() as meter:
        logged = model(x).sum()  # a forward whose graph is dropped unused
        del logged
        gc.collect()
        model(x).sum().backward()
    assert meter.peak_bytes == one.peak_bytes


def test_a_retained_graph_still_counts():
    # retain_graph keeps every saved tensor: the next forward adds to them.
    model = _model()
    x = torch.randn(16, 32)
    with saved_activation_memory() as one:
        model(x).sum().backward()
    with saved_activation_memory() as meter:
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        model(x).sum().backward()
        del loss
    # the input x is shared by both forwards' first layer, so not quite twice
    assert one.peak_bytes < meter.peak_bytes <= 2 * one.peak_bytes
