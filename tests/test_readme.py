"""The README's codec example runs as written."""

import re
from pathlib import Path


def test_readme_codec_example_runs(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("delta ") and "wrong base" in out
