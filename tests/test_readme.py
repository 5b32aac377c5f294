"""The README's codec example runs as written."""

import re
from pathlib import Path


def test_readme_codec_example_runs(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    codec_section = text[text.index("## The codec"):]
    block = re.search(r"```python\n(.*?)```", codec_section, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("delta ") and "wrong base" in out
