"""One optimizer step: halfadam's implementations against torch.optim.AdamW (see halfadam.bench).

    PYTHONPATH=src python benchmarks/bench_step.py [--large] [--json] [--device cuda]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's halfadam

from halfadam.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
