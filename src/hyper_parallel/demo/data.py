"""Training text for the demo: the Python standard library's own source, as bytes.

Every machine that runs the demo has a Python, so every machine has this corpus; nothing
is downloaded. Tokens are the raw bytes (vocabulary of 256), so no tokenizer is needed.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
from pathlib import Path

import torch

#: Vocabulary size of byte-level tokens.
VOCAB_SIZE = 256


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library sources.

    Asks ``sysconfig`` first; falls back to the directory of a pure-Python stdlib module
    (found with ``inspect``) when ``sysconfig`` points somewhere without sources.

    Raises:
        RuntimeError: when no directory with ``.py`` files is found.
    """
    candidates = [sysconfig.get_paths().get("stdlib", "")]
    candidates.append(os.path.dirname(inspect.getfile(os)))
    for cand in candidates:
        if cand and Path(cand).is_dir() and any(Path(cand).glob("*.py")):
            return Path(cand)
    raise RuntimeError(
        "hyper_parallel: could not find the Python standard library's .py sources (looked in "
        f"{candidates}); the demo trains on them. Install a Python with its sources "
        "(most distributions ship them; on Debian, libpython3-stdlib).")


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The ``.py`` files directly in the standard library directory, sorted by name
    (sorted so that every run and every machine with the same Python reads the same
    text). Sub-packages are left out: the top level alone has several MB."""
    root = stdlib_dir() if root is None else root
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(max_bytes: int = 4 * 1024 * 1024) -> torch.Tensor:
    """Byte-level tokens of the standard library sources.

    Args:
        max_bytes: stop after this many bytes (the files are concatenated in name order,
            separated by a newline).

    Returns:
        A 1-D ``torch.long`` tensor of token ids in ``[0, 256)``, at most ``max_bytes`` long.

    Raises:
        RuntimeError: when the sources are missing or hold fewer than 4 KiB.
    """
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files():
        try:
            data = path.read_bytes() + b"\n"
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 4096:
        raise RuntimeError(
            f"hyper_parallel: only {len(blob)} bytes of standard library source found in "
            f"{stdlib_dir()}; the demo needs at least 4096.")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.long)


def make_batches(tokens: torch.Tensor, *, batch: int, seq_len: int, steps: int,
                 seed: int) -> list[torch.Tensor]:
    """Fixed training batches: ``steps`` tensors of shape ``(batch, seq_len)``.

    Each row is a window of ``seq_len`` consecutive bytes starting at a position drawn
    from a generator seeded with ``seed``, so every strategy sees the very same data.

    Raises:
        ValueError: when the corpus is shorter than ``seq_len + 1`` tokens.
    """
    if tokens.numel() <= seq_len:
        raise ValueError(f"hyper_parallel: --seq-len {seq_len} is longer than the corpus "
                         f"({tokens.numel()} tokens); use a shorter sequence")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len, (steps, batch), generator=gen)
    offsets = torch.arange(seq_len)
    return [tokens[row.unsqueeze(1) + offsets] for row in starts]
