"""The sandbox boundary against what a code review found (issue 12), one test
(or more) per finding, each on the real kernel with real sandboxes; every one
of them fails on the code before the fix (docs/enforcement.md, docs/launcher.md
"The boundary").

 1 one eBPF rule for every entry point      6 rootfs: allow-listed, resolved inside, never blocking
 2 exec paths: canonical, noexec layers     7 kept/state/spool directories 0700, no setuid
 3 IPv6 covered like IPv4                   8 PID 1: an exec'd small init, the workload the OOM victim
 4 node-protecting egress defaults          9 per-identity authorisation (tenants, privileges)
 5 socket() argument rules                 10 a host uid per sandbox: per-uid limits never cross
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import textwrap
import threading
import time

import pytest

from agents import AgentProc, make_pki
from conftest import DSEC, dsec, dsec_each
from hosts import NetHost

from agent.node.client import AgentError, Client, PermissionDenied, TLS

RUN = ("run", "--audit", "off")
LDSO = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"


def _events(sid, env, *kinds):
    args = ["events", "--sandbox", sid, "--format", "json"]
    for k in kinds:
        args += ["--kind", k]
    r = dsec(*args, env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.decode().splitlines()]


def _extra(e) -> dict:
    return json.loads(e.get("extra") or "{}")


def _policy(tmp_path, name, spec: str) -> str:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {{name: {name}}}\nspec:\n"
                 + textwrap.indent(textwrap.dedent(spec), "  "))
    return str(p)


def _audited_env(tmp_path, clickhouse_url):
    return {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}


# ---------------------------------------------------------------- agents

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")), ("tenant-a", "tenant-b", "ops"))


@pytest.fixture(scope="module")
def rootfs_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rootfs-root"))


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url, pki, rootfs_root):
    from fixtures_clickhouse import free_ports
    port = free_ports(1)[0]
    a = AgentProc(str(tmp_path_factory.mktemp("bagent")), clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "16G", "reserve_memory": 0, "cpu_oversubscription": 8},
        "tcp": {"listen": f"127.0.0.1:{port}", "cert": f"{pki}/server.pem", "key": f"{pki}/server.key",
                "client_ca": f"{pki}/ca.pem", "allowed_clients": ["tenant-a", "tenant-b", "ops"]},
        "authorization": {"identities": {"tenant-a": {}, "tenant-b": {"allow": ["keep"]},
                                         "ops": {"admin": True}}},
        "rootfs_roots": [rootfs_root],
    }).start()
    a.port = port
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def _tls(agent, pki, who) -> Client:
    return Client(f"127.0.0.1:{agent.port}", tls=TLS(ca=f"{pki}/ca.pem", cert=f"{pki}/{who}.pem",
                                                     key=f"{pki}/{who}.key"))


# ---------------------------------------------------------------- 1. one rule for every entry point

def test_ebpf_rules_are_enforced_or_refused_at_every_entry_point(agent):
    """no_audit (SDK create(audit=False), gRPC no_audit) or a launcher without the
    enforcement sensor must not run a policy whose egress/exec rules live in eBPF."""
    with agent.client() as c:
        with pytest.raises(AgentError) as e:
            c.create(policy="python-tool", audit=False, warm=False)
        assert e.value.status == "FAILED_PRECONDITION", e.value
        assert "only eBPF enforces" in e.value.message and "no_audit" in e.value.message
        with c.create(policy="default", audit=False, warm=False) as sb:     # nothing of it lives in eBPF
            assert sb.exec(["true"]).code == 0
    # the launcher itself (any embedder): no enforcement sensor, no sandbox
    from agent.errors import DsecError
    from agent.sandbox.launcher import SandboxSpec, launch
    from policies.load import load_policy
    with pytest.raises(DsecError, match="only eBPF enforces"):
        launch(SandboxSpec(argv=["true"], policy=load_policy("python-tool")))


# ---------------------------------------------------------------- 2. exec paths

EXEC_PROBE = r'''
import ctypes, json, os, shutil, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
res = {}

def child(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except OSError as e:
            os._exit(100 + e.errno % 100)
        os._exit(99)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

res["allowed"] = subprocess.run(["/usr/bin/true"]).returncode
res["dotdot"] = subprocess.run(["/usr/lib/python3/../../bin/true"]).returncode

def execveat():                       # an allowed binary, named through a dirfd
    fd = os.open("/usr/bin", os.O_RDONLY | os.O_DIRECTORY)
    argv = (ctypes.c_char_p * 2)(b"true", None)
    envp = (ctypes.c_char_p * 1)(None)
    libc.syscall(322, fd, b"true", argv, envp, 0)
    raise OSError(ctypes.get_errno(), "execveat")
res["execveat"] = child(execveat)

def memfd():                          # fexecve of an in-memory copy
    fd = os.memfd_create("x", 0)
    os.write(fd, open("/usr/bin/true", "rb").read())
    os.execve(fd, ["x"], {})
res["memfd"] = child(memfd)

for d in ("/tmp", "/workspace"):
    shutil.copy("/usr/bin/true", d + "/x")
    os.chmod(d + "/x", 0o755)
    try:
        res["copy" + d] = subprocess.run([d + "/x"]).returncode
    except OSError as e:
        res["copy" + d] = "E%d" % e.errno
res["ldso"] = subprocess.run([sys.argv[1], "/tmp/x"], stderr=subprocess.DEVNULL).returncode
print(json.dumps(res))
'''


def test_exec_bypasses_are_refused_and_recorded(tmp_path, clickhouse_url, sid):
    pol = _policy(tmp_path, "exec-paths", f"""\
        mode: enforce
        exec: {{allow: ["/usr/bin/python3*", "/usr/lib/python3/*", "/usr/bin/true", "{LDSO}"]}}
        """)
    env = _audited_env(tmp_path, clickhouse_url)
    r = dsec("run", "--sandbox-id", sid, "--policy", pol, "--", "python3", "-c", EXEC_PROBE, LDSO, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["allowed"] == 0                            # the allowlist itself works
    assert res["dotdot"] == -9                            # /usr/lib/python3/* matched bytes, not the file
    assert res["execveat"] == -9                          # /dev/fd/N/true is no allowed name
    assert res["memfd"] in (-9, 113)                      # killed, or EACCES (memfd_noexec=2)
    assert res["copy/tmp"] == "E13" and res["copy/workspace"] == "E13"   # noexec writable layers
    assert res["ldso"] == 127                             # ld.so cannot map /tmp/x executable
    evs = _events(sid, env)
    denied = [e for e in evs if e["kind"] == "exec_denied"]
    status = {(e["path"] or "", tuple(_extra(e).get("status", []))) for e in denied}
    assert ("/usr/lib/python3/../../bin/true", ("not_canonical",)) in status, status
    assert any(p.startswith("/dev/fd/") and "not_canonical" in st for p, st in status), status
    assert any("mmap_noexec" in st for _, st in status), status
    execs = [e for e in evs if e["kind"] == "exec"]
    for path in ("/tmp/x", "/workspace/x"):
        assert any(e["path"] == path and e["ret"] == -13 and e["decision"] == "denied" for e in execs), path
    if res["memfd"] == 113:
        assert any(_extra(e).get("syscall") == "execveat" and e["ret"] == -13 and e["decision"] == "denied"
                   for e in execs)
    assert all(e["decision"] == "denied" for e in denied)


def test_exec_allow_written_under_lets_exactly_those_run(tmp_path):
    """The learning stream's exec.allow_written_under: [/tmp] -- files the sandbox
    writes there run; everything else it writes stays noexec."""
    pol = _policy(tmp_path, "written", """\
        mode: enforce
        exec: {allow: ["/usr/bin/python3*", "/usr/bin/true"], allow_written_under: [/tmp]}
        """)
    probe = ("import os, shutil, subprocess, json\nres = {}\n"
             "for d in ('/tmp', '/workspace'):\n"
             "    shutil.copy('/usr/bin/true', d + '/x'); os.chmod(d + '/x', 0o755)\n"
             "    try:\n        res[d] = subprocess.run([d + '/x']).returncode\n"
             "    except OSError as e:\n        res[d] = e.errno\n"
             "print(json.dumps(res))\n")
    r = dsec("run", "--policy", pol, "--", "python3", "-c", probe, env={"DSEC_SPOOL_DIR": str(tmp_path / "spool")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"/tmp": 0, "/workspace": 13}


def test_exec_allowed_matches_what_the_kernel_matches():
    from policies.compile import exec_allowed
    from policies.load import load_policy_text
    p = load_policy_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n"
                         "  exec: {allow: [/opt/tools/*, /usr/bin/true], allow_written_under: [/workspace]}\n")
    assert exec_allowed(p, "/opt/tools/a/b") and exec_allowed(p, "/usr/bin/true")
    assert exec_allowed(p, "/workspace/run.sh")
    for bad in ("/opt/tools/../../usr/bin/id", "/opt/tools/./x", "/opt/tools//x", "/opt/tools/x/..",
                "opt/tools/x", "/dev/fd/3/true", "/workspace/../etc/x", "/workspacex/y"):
        assert not exec_allowed(p, bad), bad
    from policies.model import PolicyError
    with pytest.raises(PolicyError, match="would let anything written anywhere run"):
        load_policy_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n"
                         "  exec: {allow: [/usr/bin/true], allow_written_under: [/]}\n")
    with pytest.raises(PolicyError, match="'/' writable with an exec allowlist"):
        load_policy_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n"
                         "  exec: {allow: [/usr/bin/true]}\n  files: {writable: [/]}\n")


# ---------------------------------------------------------------- 3. IPv6

V6_PROBE = r'''
import socket, sys
print("v6off", open("/proc/sys/net/ipv6/conf/eth0/disable_ipv6").read().strip(), flush=True)
target = sys.stdin.readline().strip()
try:
    s = socket.socket(socket.AF_INET6)
    s.settimeout(3)
    s.connect((target, int(sys.argv[1]), 0, socket.if_nametoindex("eth0")))
    print("result connected", flush=True)
except OSError as e:
    print("result", type(e).__name__, flush=True)
'''


def _link_local(ifname: str, timeout=5.0) -> str | None:
    """The (non-tentative) fe80:: address of a host interface, if it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", ifname, "scope", "link"],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            if "tentative" not in line:
                return line.split()[3].split("/")[0]
        if not out.strip():
            return None
        time.sleep(0.1)
    return None


def _reach_host_over_v6(sid, args, port, enable_host_v6=False, env=None):
    from agent.sandbox import netns
    p = subprocess.Popen([DSEC, *args, "--sandbox-id", sid, "--network", "egress", "--", "python3", "-c", V6_PROBE,
                          str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, **(env or {})))
    try:
        first = p.stdout.readline().decode().split()
        host_if = netns.ifnames(sid)[0]
        if enable_host_v6:         # the host end with IPv6 on: only the firewall stands in between
            with open(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6", "w") as f:
                f.write("0")
        target = _link_local(host_if) or "fe80::1"
        p.stdin.write((target + "\n").encode())
        p.stdin.flush()
        result = p.stdout.readline().decode().split()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return first, result, target


def test_ipv6_cannot_reach_the_host_over_link_local(tmp_path, clickhouse_url, sid):
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind(("::", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        # the default policy: IPv6 is disabled inside, the host end has none either
        first, result, target = _reach_host_over_v6(sid, RUN, port)
        assert first == ["v6off", "1"], first
        assert result and result[0] == "result" and result[1] != "connected", (result, target)
        # a policy that allows IPv6 egress keeps IPv6 on; the host is still out of reach
        # (the inet firewall drops it at the host's input), even with the host end's IPv6 on
        pol = _policy(tmp_path, "v6", """\
            egress:
              default: deny
              allow: [{cidr: "fe80::/10"}, {cidr: "2001:db8::/32"}]
            """)
        first, result, target = _reach_host_over_v6(sid + "b", ("run", "--policy", pol), port, enable_host_v6=True,
                                                    env=_audited_env(tmp_path, clickhouse_url))
        assert first == ["v6off", "0"], first
        assert target.startswith("fe80:"), target
        assert result and result[1] != "connected", (result, target)
    finally:
        srv.close()


# ---------------------------------------------------------------- 4. node-protecting egress defaults

NET_PROBE = r'''
import errno, json, socket, sys
res = {}
for a in sys.argv[1:]:
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((a, 8080)); res[a] = "ok"
    except OSError as e:
        res[a] = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    finally:
        s.close()
print(json.dumps(res))
'''


def test_egress_without_rules_protects_the_node(tmp_path, clickhouse_url):
    addrs = ["169.254.169.254", "10.200.14.2", "10.200.14.3", "198.51.100.14"]
    with NetHost(subnet=14, extra_addrs=["169.254.169.254", "10.200.14.3", "198.51.100.14"]) as th:
        th.serve_http(addr="0.0.0.0")
        r = dsec(*RUN, "--network", "egress", "--", "python3", "-c", NET_PROBE, *addrs)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["198.51.100.14"] == "ok", res                     # the world is reachable
        for a in addrs[:3]:                                         # the node's surroundings are not
            assert res[a] != "ok", res
        # a policy opens them explicitly (its rules are eBPF's: audit on)
        pol = _policy(tmp_path, "open-private", """\
            egress:
              default: deny
              allow: [{cidr: 10.200.14.2/32, ports: [8080], protocol: tcp}]
            """)
        r = dsec("run", "--network", "egress", "--policy", pol, "--", "python3", "-c", NET_PROBE, *addrs,
                 env=_audited_env(tmp_path, clickhouse_url))
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["10.200.14.2"] == "ok" and res["169.254.169.254"] == "EPERM", res
    show = dsec("policy", "show", "default").stdout.decode()
    assert "169.254.0.0/16" in show and "refused" in show and "fe80::/10" in show


# ---------------------------------------------------------------- 5. socket() arguments

SOCK_PROBE = r'''
import errno, json, socket
res = {}
for name, args in [("unix", (1, 1, 0)), ("tcp", (2, 1, 0)), ("udp6", (10, 2, 0)), ("vsock", (40, 1, 0)),
                   ("packet", (17, 3, 0)), ("raw", (2, 3, 1)), ("icmp", (2, 2, 1)), ("sctp", (2, 1, 132)),
                   ("netlink", (16, 3, 0))]:
    try:
        socket.socket(*args).close(); res[name] = "ok"
    except OSError as e:
        res[name] = errno.errorcode[e.errno]
print(json.dumps(res))
'''
REFUSED = {"vsock": "EAFNOSUPPORT", "packet": "EAFNOSUPPORT", "netlink": "EAFNOSUPPORT",
           "raw": "EPROTONOSUPPORT", "icmp": "EPROTONOSUPPORT", "sctp": "EPROTONOSUPPORT"}


def test_default_policy_allows_only_plain_sockets(tmp_path, clickhouse_url, sid):
    env = _audited_env(tmp_path, clickhouse_url)
    # enforce (the default policy) and audit mode, side by side
    r, ra = dsec_each(("run", "--sandbox-id", sid, "--user", "root", "--", "python3", "-c", SOCK_PROBE),
                      ("run", "--sandbox-id", sid + "a", "--policy", "default-audit", "--user", "root", "--",
                       "python3", "-c", SOCK_PROBE), env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {k: res[k] for k in ("unix", "tcp", "udp6")} == {"unix": "ok", "tcp": "ok", "udp6": "ok"}, res
    assert {k: res[k] for k in REFUSED} == REFUSED, res          # seccomp's errnos, not the kernel's EPERM
    denied = [e for e in _events(sid, env, "syscall_denied") if e["syscall"] == "socket"]
    assert sum(e["count"] for e in denied) == len(REFUSED), denied
    assert _extra(denied[0])["socket"]["family"] in ("vsock", "packet", "inet", "netlink"), denied[0]
    # audit mode: nothing refused, every one reported
    assert json.loads(ra.stdout)["vsock"] == "ok", ra.stderr
    viol = [e for e in _events(sid + "a", env, "syscall_violation") if e["syscall"] == "socket"]
    assert sum(e["count"] for e in viol) == len(REFUSED), viol
    # a policy widens it
    pol = _policy(tmp_path, "vsock", """\
        syscalls:
          default: allow
          sockets: [{family: unix}, {family: inet}, {family: inet6}, {family: vsock}]
        """)
    r = dsec(*RUN, "--policy", pol, "--user", "root", "--", "python3", "-c", SOCK_PROBE)
    res = json.loads(r.stdout)
    assert res["vsock"] == "ok" and res["raw"] != "EPROTONOSUPPORT" and res["netlink"] == "EAFNOSUPPORT", res


# ---------------------------------------------------------------- 6. rootfs

def _dash_rootfs(rf):
    for d in ("bin", "etc"):
        os.makedirs(os.path.join(rf, d), exist_ok=True)
    shutil.copy2("/bin/dash", os.path.join(rf, "bin", "sh"))
    libs = subprocess.run(["ldd", "/bin/dash"], capture_output=True, text=True).stdout
    for line in libs.splitlines():
        for tok in line.split():
            if tok.startswith("/"):
                dest = os.path.join(rf, tok.lstrip("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copy2(tok, dest)


def test_rootfs_paths_resolve_inside_it_and_never_block(tmp_path):
    # a symlink in the rootfs pointing at the host, plus files.writable under it
    outside = tmp_path / "host-dir"
    outside.mkdir()
    rf = str(tmp_path / "rootfs")
    _dash_rootfs(rf)
    os.symlink(str(outside), os.path.join(rf, "workspace"))
    pol = _policy(tmp_path, "w", "files: {writable: [/workspace/out]}\n")
    r = dsec(*RUN, "--rootfs", rf, "--workdir", "/", "--policy", pol, "--", "/bin/sh", "-c", "echo in")
    assert os.listdir(outside) == [], "dsec created something on the host through the rootfs' symlink"
    assert r.returncode in (0, 125) and b"Traceback" not in r.stderr, r.stderr
    # a FIFO where /etc/passwd should be: never opened blocking
    rf2 = str(tmp_path / "rootfs2")
    _dash_rootfs(rf2)
    os.mkfifo(os.path.join(rf2, "etc", "passwd"))
    try:
        r = dsec(*RUN, "--rootfs", rf2, "--workdir", "/", "--", "/bin/sh", "-c", "echo ran", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("dsec run blocked on a FIFO in the rootfs")
    assert r.returncode == 0 and r.stdout == b"ran\n", r.stderr
    r = dsec(*RUN, "--rootfs", rf2, "--user", "nobody2", "--", "/bin/sh", "-c", "true", timeout=60)
    assert r.returncode == 125 and b"--user nobody2" in r.stderr


def test_rootfs_is_never_the_host_or_dsec_state(agent, pki, rootfs_root):
    with agent.client() as c:                # even the admin (unix socket)
        for bad in ("/", "/proc/1/root", "/var/lib/dsec", "/var/lib/dsec/sandboxes"):
            with pytest.raises(AgentError) as e:
                c.create(rootfs=bad, warm=False)
            assert e.value.status in ("INVALID_ARGUMENT", "PERMISSION_DENIED"), (bad, e.value)
    with _tls(agent, pki, "ops") as c:       # an admin identity over TCP: only under rootfs_roots
        for bad in ("/", "/usr"):
            with pytest.raises(AgentError):
                c.create(rootfs=bad, warm=False)
    rf = os.path.join(rootfs_root, "img")
    _dash_rootfs(rf)
    with _tls(agent, pki, "tenant-a") as c:
        with pytest.raises(PermissionDenied):
            c.create(rootfs=rf, warm=False)   # tenant-a lacks the rootfs privilege


# ---------------------------------------------------------------- 7. kept trees, state, spool

def test_kept_trees_and_state_are_root_only_without_setuid(tmp_path):
    sid = "keep-" + os.urandom(4).hex()
    r = dsec(*RUN, "--sandbox-id", sid, "--user", "root", "--keep", "--", "sh", "-c",
             "cp /bin/dash /opt/sh && chmod 6755 /opt/sh && mkdir -m 2777 /opt/d")
    assert r.returncode == 0, r.stderr
    kept = f"/var/lib/dsec/kept/{sid}"
    try:
        for d in ("/var/lib/dsec/kept", kept, "/var/lib/dsec/sandboxes"):
            assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0, (d, oct(os.stat(d).st_mode))
        for p in (f"{kept}/_root/opt/sh", f"{kept}/_root/opt/d"):
            assert os.stat(p).st_mode & (stat.S_ISUID | stat.S_ISGID) == 0, (p, oct(os.stat(p).st_mode))
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    from exporters.spool import Spool
    d = tmp_path / "spool"
    d.mkdir(mode=0o755)
    Spool(str(d)).close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


# ---------------------------------------------------------------- 8. PID 1

def test_pid1_is_a_small_exec_init_and_the_workload_the_oom_victim():
    r = dsec(*RUN, "--", "sh", "-c",
             "tr '\\0' ' ' < /proc/1/cmdline; echo; grep VmRSS /proc/1/status; "
             "cat /proc/1/environ >/dev/null 2>&1 && echo environ-readable || echo environ-closed; "
             "cat /proc/self/oom_score_adj")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert lines[0].strip() == "dsec-init", lines[0]             # its own name only, no agent argv
    assert int(lines[1].split()[1]) < 4096, lines[1]              # kB: a small init, not a fork of Python
    assert lines[2] == "environ-closed"                           # not dumpable: nothing of it to read
    assert lines[3] == "1000"


def test_oom_is_reported_as_oom_and_the_sandbox_lives_on(agent):
    with agent.client() as c:
        with c.create(memory="64M", warm=False) as sb:
            r = sb.exec(["python3", "-c", "b=[]\nfor i in range(200): b.append(bytearray(4<<20))"], timeout=60)
            assert r.oom_killed and r.signal == 9, r
            assert sb.exec(["echo", "alive"]).stdout == b"alive\n"
            assert c.get(sb.id).state == "running"


# ---------------------------------------------------------------- 9. authorisation

def _access_denied(clickhouse_url, who, timeout=30):
    from replay.store import AuditStore
    deadline = time.monotonic() + timeout
    recs = []
    while time.monotonic() < deadline:
        with AuditStore(clickhouse_url) as store:
            recs = [json.loads(e["extra"]) for e in store.events("", ["access_denied"])]
        recs = [r for r in recs if who in r.get("identities", [])]
        if recs:
            return recs
        time.sleep(0.5)
    return recs


def test_identities_have_privileges_and_see_only_their_tenant(agent, pki, clickhouse_url):
    with _tls(agent, pki, "tenant-a") as a, _tls(agent, pki, "tenant-b") as b, _tls(agent, pki, "ops") as ops:
        for spec in ({"user": "root"}, {"user": "0"}, {"keep": True}, {"audit": False},
                     {"policy_yaml": "apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec: {}\n"},
                     {"labels": {"tenant": "tenant-b"}}, {"volumes": ["/srv/x:/x"]}):
            with pytest.raises(PermissionDenied):
                a.create(warm=False, **spec)
        with a.create(warm=False, labels={"job": "j1"}) as sa:
            assert sa.info().labels.get("tenant") == "tenant-a"
            assert sa.exec(["id", "-un"]).stdout == b"sandbox\n"
            for call in (lambda: b.get(sa.id), lambda: b.sandbox(sa.id).exec(["true"]),
                         lambda: b.kill(sa.id), lambda: b.close_sandbox(sa.id),
                         lambda: next(iter(b.events(sandbox=sa.id))),
                         lambda: b.snapshot(sa.id), lambda: b.restore(sa.id, "ab" * 8),
                         lambda: b.create(warm=False, from_snapshot="ab" * 8)):
                with pytest.raises(PermissionDenied):
                    call()
            assert sa.id not in [i.sandbox_id for i in b.list()]
            assert sa.id in [i.sandbox_id for i in a.list()]
            assert sa.id in [i.sandbox_id for i in ops.list()]       # admin sees every tenant
            with pytest.raises(PermissionDenied):
                b.list(labels={"tenant": "tenant-a"})
            with b.create(warm=False, keep=True) as sbk:                # tenant-b has keep
                assert sbk.info().labels["tenant"] == "tenant-b"
            shutil.rmtree(ops.get(sbk.id).summary["kept_upper"])       # (the kept tree: not left behind)
    recs = _access_denied(clickhouse_url, "tenant-a")
    assert any("may not use root" in r["reason"] for r in recs), recs
    assert _access_denied(clickhouse_url, "tenant-b")
    with agent.client() as c:                                      # the unix socket stays admin
        with c.create(user="root", warm=False) as sr:
            assert sr.exec(["id", "-u"]).stdout == b"0\n"


# ---------------------------------------------------------------- 10. a uid per sandbox

HOLD = r'''
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while n < 1000 and libc.inotify_init1(0) >= 0:
    n += 1
print("held", n, flush=True)
time.sleep(30)
'''
ONE = r'''
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
print("ok" if libc.inotify_init1(0) >= 0 else errno.errorcode[ctypes.get_errno()])
'''


def test_per_uid_limits_never_cross_sandboxes():
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    with open("/proc/sys/fs/inotify/max_user_instances") as f:
        limit = int(f.read())
    a = Sandbox(SandboxSpec(argv=[])).start()
    b = Sandbox(SandboxSpec(argv=[])).start()
    try:
        r, w = os.pipe()
        t = threading.Thread(target=a.exec, args=(["python3", "-c", HOLD],), kwargs={"stdout": w, "timeout": 60})
        t.start()
        with os.fdopen(r) as out:
            held = out.readline().split()
            assert held == ["held", str(limit)], held            # one sandbox at its per-uid limit ...
            r2, w2 = os.pipe()
            res = b.exec(["python3", "-c", ONE], stdout=w2)
            os.close(w2)
            assert res.code == 0
            assert os.read(r2, 100) == b"ok\n"                   # ... and another still opens one
            os.close(r2)
        ids = []
        for sb in (a, b):
            r3, w3 = os.pipe()
            sb.exec(["sh", "-c", "id -un; id -u; stat -c %U /workspace"], stdout=w3)
            os.close(w3)
            ids.append(os.read(r3, 200).decode().split())
            os.close(r3)
        assert ids[0][0] == ids[1][0] == "sandbox" and ids[0][2] == ids[1][2] == "sandbox", ids
        assert ids[0][1] != ids[1][1] and int(ids[0][1]) >= 100000, ids    # not a login of the node
        a.signal(9)
        t.join(30)
        os.close(w)
    finally:
        a.close()
        b.close()
