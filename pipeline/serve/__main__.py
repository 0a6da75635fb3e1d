"""Run as: python -m pipeline.serve --recipe recipes/serve/qwen2.5-coder-1.5b-cpu.yaml [key=value ...]"""

from .cli import main

main()
