"""Exit 0 when every pin of requirements.txt is installed (and torch is 2.6-2.14).

Lets scripts/setup.sh skip pip on a machine that is already set up.
"""

import sys
from importlib import metadata
from pathlib import Path


def main() -> int:
    missing = []
    for line in (Path(__file__).resolve().parent.parent / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        try:
            if metadata.version(name) != version:
                missing.append(line)
        except metadata.PackageNotFoundError:
            missing.append(line)
    try:
        major, minor = (int(p) for p in metadata.version("torch").split("+")[0].split(".")[:2])
        if not (2, 6) <= (major, minor) <= (2, 14):
            missing.append("torch (2.6 to 2.14)")
    except metadata.PackageNotFoundError:
        missing.append("torch")
    if missing:
        print("missing: " + ", ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
