"""`python -m raysys`: the CLI (`raysys.cli`).

Run from the parent directory of a clone named `raysys`, Python takes that clone for a namespace package `raysys`
(the current directory comes first on sys.path, and an editable install's finder only answers after the path has
been searched), so `raysys.results.records` would be the clone's `results/` folder. Then this file, found through the
install, puts the package's own parent first and imports the package again.
"""

import os
import sys

if getattr(sys.modules.get("raysys"), "__file__", None) is None:  # the namespace package of a clone's parent dir
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in [m for m in sys.modules if m == "raysys" or m.startswith("raysys.")]:
        del sys.modules[name]

from raysys.cli import main  # noqa: E402

sys.exit(main())
