"""The seccomp program of a policy is laid out as a binary search over syscall numbers
(libseccomp's SCMP_FLTATR_CTL_OPTIMIZE=2): the kernel loads it in about half the time of
the linear chain, paid by every step's process (docs/launch-figures.md). Same decisions:
tests/test_enforce_e2e.py and tests/test_policy.py run the filters themselves."""
import pytest

seccomp = pytest.importorskip("seccomp")

from policies.compile import seccomp_filter  # noqa: E402
from policies.load import load_policy  # noqa: E402


@pytest.mark.parametrize("name", ["default"])
def test_filter_is_a_binary_tree(name):
    f = seccomp_filter(load_policy(name))
    assert f.get_attr(seccomp.Attr.CTL_OPTIMIZE) == 2
