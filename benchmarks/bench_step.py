"""One optimizer step: halfadam's implementations against torch.optim.AdamW (see halfadam.bench).

    PYTHONPATH=src python benchmarks/bench_step.py [--large] [--json] [--device cuda]
"""

import sys

from halfadam.bench import main

if __name__ == "__main__":
    sys.exit(main())
