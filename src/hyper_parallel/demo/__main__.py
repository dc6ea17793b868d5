"""Entry point of ``python -m hyper_parallel.demo``."""

from .cli import main

if __name__ == "__main__":
    main()
