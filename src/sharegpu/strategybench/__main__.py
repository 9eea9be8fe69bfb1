"""``python -m sharegpu.strategybench``: ``sharegpu bench`` without the rest of the command line."""

import typer

from sharegpu.strategybench.cli import bench

if __name__ == "__main__":
    typer.run(bench)
