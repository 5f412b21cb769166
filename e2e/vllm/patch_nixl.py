#!/usr/bin/env python3
"""Make NIXL's UCX progress thread sleep between polls (env NIXL_PTHR_DELAY_US, microseconds).

nixl_cu12/_api.py hard-codes pthrDelay=0: a busy-spinning progress thread per engine, which
on a 2-core machine starves the engines and makes the NIXL handshake (a 5 s ZMQ timeout)
fail. Idempotent.
"""

import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("nixl_cu12")
if spec is None or spec.origin is None:
    sys.exit("nixl_cu12 is not installed")
path = pathlib.Path(spec.origin).parent / "_api.py"
source = path.read_text()
if "NIXL_PTHR_DELAY_US" in source:
    print("already patched:", path)
    sys.exit(0)
old = "        agent_config.pthrDelay = 0\n"
new = (
    "        import os as _os\n"
    '        agent_config.pthrDelay = int(_os.environ.get("NIXL_PTHR_DELAY_US", "0"))\n'
    '        if _os.environ.get("NIXL_DISABLE_PROG_THREAD") == "1":\n'
    "            agent_config.useProgThread = False\n"
)
assert source.count(old) == 1, "unexpected nixl _api.py layout"
path.write_text(source.replace(old, new))
print("patched:", path)
