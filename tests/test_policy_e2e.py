"""Policies applied by `dsec run`: seccomp and the files layout, on the real
kernel, with the decisions recorded in ClickHouse."""
from __future__ import annotations

import json
import os
import textwrap
import uuid

import pytest

from conftest import dash_rootfs, dsec, dsec_each

ATTACKS = textwrap.dedent(r'''
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, *args):
        r = getattr(libc, name)(*args)
        e = ctypes.get_errno()
        print(name, "ok" if r >= 0 else errno.errorcode.get(e, e))
    call("unshare", 0x10000000)                       # CLONE_NEWUSER
    call("unshare", 0x00020000)                       # CLONE_NEWNS
    call("mount", b"none", b"/tmp", b"tmpfs", 0, None)
    call("ptrace", 16, 1, 0, 0)                       # PTRACE_ATTACH to PID 1
    call("syscall", 321, 0, 0, 0)                     # bpf(BPF_MAP_CREATE, NULL, 0)
    call("syscall", 250, 0, 0, 0, 0)                  # keyctl
    call("syscall", 425, 8, 0)                        # io_uring_setup
    print("getpid", "ok" if os.getpid() > 0 else "bad")
''')


def results(stdout: bytes) -> dict:
    return dict(line.split(" ", 1) for line in stdout.decode().splitlines())


def test_default_policy_refuses_what_runtimes_refuse():
    r = dsec("run", "--audit", "off", "--", "python3", "-c", ATTACKS)
    assert r.returncode == 0, r.stderr
    res = results(r.stdout)
    for name in ("unshare", "mount", "ptrace", "syscall"):
        assert res[name] == "EPERM", res
    assert res["getpid"] == "ok"


def test_audit_mode_lets_the_same_calls_through():
    r = dsec("run", "--audit", "off", "--mode", "audit", "--", "python3", "-c",
             "import ctypes, errno\nl = ctypes.CDLL(None, use_errno=True)\n"
             "r = l.unshare(0x10000000)\nprint('unshare', 'ok' if r == 0 else errno.errorcode[ctypes.get_errno()])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b"unshare ok"


def test_kill_action_kills(tmp_path):
    pol = tmp_path / "kill.yaml"
    pol.write_text(textwrap.dedent("""\
        apiVersion: dsec/v1
        kind: SandboxPolicy
        metadata: {name: kill-ptrace}
        spec:
          mode: enforce
          syscalls: {default: allow, action: kill, deny: [ptrace]}
        """))
    r = dsec("run", "--audit", "off", "--policy", str(pol), "--", "python3", "-c",
             "import ctypes; ctypes.CDLL(None).ptrace(0, 0, 0, 0); print('survived')")
    assert b"survived" not in r.stdout
    assert r.returncode == 128 + 31   # SIGSYS


def test_bad_policy_is_one_line_125(tmp_path):
    pol = tmp_path / "bad.yaml"
    pol.write_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n"
                   "  mode: enforce\n  syscalls: {default: allow, deny: [opne]}\n")
    r = dsec("run", "--policy", str(pol), "--", "true")
    assert r.returncode == 125
    err = [ln for ln in r.stderr.decode().splitlines() if not ln.startswith("dsec: sandbox")]
    assert len(err) == 1 and "bad.yaml:6" in err[0] and "opne" in err[0], err


WS_POLICY = textwrap.dedent("""\
    apiVersion: dsec/v1
    kind: SandboxPolicy
    metadata: {name: ws-only}
    spec:
      mode: %s
      files: {writable: [/workspace]}
    """)


@pytest.fixture(scope="module")
def ws_runs(tmp_path_factory, clickhouse_url):
    """mode -> (sandbox id, env, the run), both modes side by side (each in-process
    run spends seconds of a core compiling its eBPF programs)."""
    tmp = tmp_path_factory.mktemp("ws")
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp / "spool")}
    calls, sids = [], {}
    for mode in ("enforce", "audit"):
        pol = tmp / f"ws-{mode}.yaml"
        pol.write_text(WS_POLICY % mode)
        sids[mode] = f"ws-{mode}-{tmp.name[-6:]}"
        # /var/tmp (1777): uid 1000 may write there, the policy does not let it; /opt (root 0755):
        # uid 1000 may not write there anyway, whatever the policy says
        calls.append(("run", "--sandbox-id", sids[mode], "--policy", str(pol), "--", "sh", "-c",
                      "echo ok > /workspace/ok && echo ws-ok; (echo x > /var/tmp/x) 2>/dev/null && echo vt-ok; "
                      "(echo x > /opt/x) 2>/dev/null && echo opt-ok; echo t > /tmp/t && echo tmp-ok"))
    runs = dsec_each(*calls, env=env)
    return {m: (sids[m], env, r) for m, r in zip(("enforce", "audit"), runs)}


@pytest.mark.parametrize("mode", ["enforce", "audit"])
def test_files_writable_layout_and_decisions(mode, ws_runs):
    sid, env, r = ws_runs[mode]
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode().split()
    if mode == "enforce":
        assert out == ["ws-ok", "tmp-ok"]
    else:
        assert out == ["ws-ok", "vt-ok", "tmp-ok"]
    ev = [json.loads(x) for x in dsec("events", "--sandbox", sid, "--format", "json", "--kind", "open_write",
                                      env=env).stdout.decode().splitlines()]
    by_path = {e["path"]: e for e in ev}
    assert by_path["/workspace/ok"]["decision"] == "allowed"
    assert by_path["/tmp/t"]["decision"] == "allowed"
    vt, opt = by_path["/var/tmp/x"], by_path["/opt/x"]
    assert vt["policy_name"] == "ws-only" and vt["mode"] == mode and len(vt["policy_hash"]) == 64
    if mode == "enforce":
        assert vt["decision"] == "denied" and vt["ret"] == -30      # EROFS: the layout refused it
        # EROFS too (the read-only mount answers first), but the agent found uid 1000 has no
        # write permission on /opt: the kernel would have refused it anyway -- not a policy denial
        assert opt["decision"] == "failed" and opt["ret"] == -30, opt
        ex = json.loads(opt["extra"])
        assert ex["refused_anyway"] == "EACCES" and "/opt is 0:0 drwxr-xr-x" in ex["refused_anyway_by"], ex
        assert "refused_anyway" not in json.loads(vt["extra"])
    else:
        # audit: the layout leaves /var/tmp writable, the write went through (an fd) and is reported
        assert vt["decision"] == "would-deny" and vt["ret"] >= 0, vt
        assert opt["decision"] == "failed" and opt["ret"] == -13     # EACCES: failed on its own
        assert "refused_anyway" not in json.loads(opt["extra"] or "{}")


def test_refused_anyway_reads_the_sandboxs_own_files(tmp_path, clickhouse_url):
    """Whether an EROFS write "would have failed anyway" is read from the mode bits in the
    sandbox's root, never the host's. Here /srv is uid 1000's in the sandbox (a rootfs of the
    test's own) and root's (0755) on the host: uid 1000's write there is refused by the policy's
    read-only layout alone, a policy denial. The check's root was opened before dsec-init's
    pivot_root, i.e. the host's tree, which said "0:0 drwxr-xr-x: refused anyway" and turned
    the denial into a write that merely failed."""
    host_srv = os.stat("/srv")
    assert host_srv.st_uid == 0 and not host_srv.st_mode & 0o002     # the host's /srv: not uid 1000's
    rf = dash_rootfs(tmp_path / "rootfs")
    (rf / "srv").mkdir(mode=0o755)
    os.chown(rf / "srv", 1000, 1000)
    pol = tmp_path / "ws-only.yaml"
    pol.write_text(WS_POLICY % "enforce")
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}
    sid = "srv-" + uuid.uuid4().hex[:10]
    r = dsec("run", "--sandbox-id", sid, "--rootfs", str(rf), "--user", "1000:1000", "--workdir", "/",
             "--policy", str(pol), "--", "/bin/sh", "-c", "(echo x > /srv/x) 2>/dev/null || echo refused",
             env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [b"refused"]
    ev = [json.loads(x) for x in dsec("events", "--sandbox", sid, "--format", "json", "--kind", "open_write",
                                      env=env).stdout.decode().splitlines()]
    srv = {e["path"]: e for e in ev}["/srv/x"]
    assert srv["ret"] == -30 and srv["uid"] == 1000, srv                 # EROFS: the layout refused it
    assert srv["decision"] == "denied", srv
    assert "refused_anyway" not in json.loads(srv["extra"] or "{}"), srv


def test_audit_off_refuses_policies_enforced_in_ebpf():
    """--audit off does not load eBPF; a policy whose egress/exec rules live there must not run unenforced."""
    r = dsec("run", "--audit", "off", "--policy", "python-tool", "--", "true")
    assert r.returncode == 125 and b"unenforced" in r.stderr
