"""A model zoo for decisions: hvd_dgc's defaults and every recommended setting against
Horovod on six (model, recipe) pairs, several seeds (harness/zoo.py holds the pairs).

    python bench/zoo.py                  # every pair, setting and seed
    python bench/zoo.py --report         # bench/results/zoo.md and its plot from the CSV
    python bench/zoo.py --link 100       # samples/s over two emulated hosts
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.zoo import main  # noqa: E402

if __name__ == "__main__":
    main()
