"""Where the tests find the repository's files, wherever a test module sits in the tree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CAPTURES = ROOT / "tests" / "captures"  # wire captures of real vLLM 0.32 engines
