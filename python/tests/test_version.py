"""attn.__version__ has one home: project(attn VERSION ...) in CMakeLists.txt (issue 15)."""
import os
import re

import attn


def test_version_is_the_cmake_project_version():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        want = re.search(r"project\(attn VERSION ([0-9.]+)", f.read()).group(1)
    assert attn.__version__ == want
