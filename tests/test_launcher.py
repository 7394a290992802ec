"""dsec run: real sandboxes on the real kernel."""
from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import DSEC, dash_rootfs, dsec
from hosts import NetHost, leftovers, wait_clean


# The launcher's guarantees do not depend on auditing; these tests run without the
# eBPF recorder (each audited `dsec run` compiles its programs: see test_audit_e2e.py).
RUN = ("run", "--audit", "off")


def run_json(tmp_path, *args, **kw):
    out = tmp_path / "summary.json"
    r = dsec(*RUN, "--summary-json", str(out), *args, **kw)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_pid1_is_supervisor_and_host_processes_invisible(sid):
    r = dsec(*RUN, "--sandbox-id", sid, "--", "sh", "-c",
             "cat /proc/1/comm; ls /proc | grep -c '^[0-9]'; hostname; cat /proc/$$/status | grep -E 'NoNewPrivs|CapBnd|CapEff'")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().split("\n")
    assert lines[0] == "dsec-init"
    assert int(lines[1]) <= 5          # supervisor, sh, ls, grep (+cat)
    assert lines[2] == sid             # hostname = sandbox id
    status = "\n".join(lines[3:])
    assert "NoNewPrivs:\t1" in status
    assert "CapBnd:\t0000000000000000" in status
    assert "CapEff:\t0000000000000000" in status
    # the test's own process is invisible inside
    r = dsec(*RUN, "--", "sh", "-c", f"test -e /proc/{os.getpid()}/cmdline && cat /proc/{os.getpid()}/cmdline")
    assert b"pytest" not in r.stdout


def test_root_inside_has_no_capabilities():
    r = dsec(*RUN, "--user", "root", "--", "sh", "-c",
             "id -u; grep -E 'CapEff|CapPrm|CapBnd' /proc/self/status; echo 1 > /proc/sys/kernel/hostname; echo rc=$?")
    out = r.stdout.decode()
    assert out.startswith("0\n")
    assert "CapEff:\t0000000000000000" in out and "CapPrm:\t0000000000000000" in out
    assert "rc=0" not in out   # /proc/sys is read-only


@pytest.fixture
def host_secrets():
    made = []
    for d in ("/root", "/home/dsec-test-user"):
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "dsec-secret-canary")
        with open(p, "w") as f:
            f.write("CANARY-SECRET\n")
        made.append(p)
    os.makedirs("/var/dsec-test", exist_ok=True)
    with open("/var/dsec-test/secret", "w") as f:
        f.write("CANARY-SECRET\n")
    made.append("/var/dsec-test/secret")
    yield made
    for p in made:
        os.unlink(p)
    os.rmdir("/home/dsec-test-user")
    os.rmdir("/var/dsec-test")


@pytest.mark.parametrize("user", ["sandbox", "root"])
def test_host_secrets_not_readable(host_secrets, user):
    script = "; ".join(f"cat {p} 2>/dev/null" for p in host_secrets + ["/etc/shadow", "/etc/ssh/ssh_host_rsa_key"])
    r = dsec(*RUN, "--user", user, "--", "sh", "-c", script + "; ls /var /home /root 2>/dev/null; true")
    assert r.returncode == 0
    assert b"CANARY" not in r.stdout and b"dsec-secret-canary" not in r.stdout
    assert b"dsec-test" not in r.stdout


def test_write_etc_passwd_stays_inside(tmp_path):
    before = hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest()
    r, s = run_json(tmp_path, "--user", "root", "--", "sh", "-c",
                    "echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd && grep -c evil /etc/passwd && touch /usr/dsec-canary")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b"1"
    assert hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest() == before
    assert not os.path.exists("/usr/dsec-canary")
    ch = {c["path"]: c for c in s["changes"]}
    assert ch["/etc/passwd"]["change"] == "modified"
    assert ch["/etc/passwd"]["kind"] == "file"
    assert len(ch["/etc/passwd"]["sha256"]) == 64
    assert ch["/usr/dsec-canary"]["change"] == "added"
    assert ch["/usr/dsec-canary"]["size"] == 0


def test_writable_layers_are_volatile_a_workloads_sync_stays_in_the_sandbox():
    """The writable layers are mounted volatile: an overlay's sync (every umount at close, a
    workload's fsync or syncfs) would sync the whole host file system under /var/lib/dsec
    (the node's root here): a workload calling syncfs() in a loop stalled the node's disk."""
    r = dsec(*RUN, "--", "sh", "-c", "grep ' overlay ' /proc/self/mountinfo")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) >= 2, lines                 # the root and /usr at least
    for ln in lines:
        assert "fsync=volatile" in ln or ",volatile" in ln, ln


MASK_PROBE = r"""
import os
info = {}
for ln in open("/proc/self/mountinfo"):
    f = ln.split()
    info[f[4]] = (f[2], set(f[5].split(",")), ln.split(" - ")[1].split()[0])
out = []
for m in MASKED:
    if not os.path.lexists(m):
        continue
    if os.path.isdir(m):
        dev, flags, fstype = info[m]
        w = None
        try:
            open(os.path.join(m, "x"), "w")
        except OSError as e:
            w = e.errno
        out.append(("dir", m, dev, sorted(flags & {"ro", "nosuid", "nodev", "noexec"}), fstype, os.listdir(m), w))
    else:
        try:
            data = open(m, "rb").read(64)
        except OSError as e:
            data = e.errno
        out.append(("file", m, data))
print(repr(out))
"""


def test_masked_paths_are_empty_and_read_only():
    """The OCI runtimes' masked paths (agent/sandbox/plan.py MASKED): a masked directory is an
    empty tmpfs, read-only, nosuid, nodev, noexec, one superblock shared by all of them
    (dsec-init mounts it once and binds it: each superblock is a registration under a kernel-wide
    lock that a busy node's memory-cgroup removals walk); a masked file reads as /dev/null."""
    from agent.sandbox.plan import MASKED
    probe = f"MASKED = {MASKED!r}" + MASK_PROBE
    r = dsec(*RUN, "--", "python3", "-I", "-c", probe)
    assert r.returncode == 0, r.stderr
    out = ast.literal_eval(r.stdout.decode().strip())
    dirs = [o for o in out if o[0] == "dir"]
    files = [o for o in out if o[0] == "file"]
    assert len(dirs) >= 3 and files, out         # /sys/firmware, /sys/kernel/debug, /sys/fs/bpf; /proc/kcore
    for _, m, dev, flags, fstype, listing, werr in dirs:
        assert fstype == "tmpfs" and flags == ["nodev", "noexec", "nosuid", "ro"], (m, fstype, flags)
        assert listing == [] and werr in (errno.EROFS, errno.EACCES), (m, listing, werr)   # EACCES: not root
    assert len({d[2] for d in dirs}) == 1, dirs   # one superblock
    for _, m, data in files:
        assert data == b"", (m, data)


def test_sandbox_state_dirs_are_spread_over_the_file_system(tmp_path):
    """The sandboxes' directory carries ext4's "top of a hierarchy" flag (chattr +T): each
    sandbox's state directory (its upper and work layers, what the overlay creates there)
    goes to a block group of the allocator's choosing instead of all beside one another,
    where every inode allocation of a no-journal ext4 walks the group's recently deleted
    inodes one by one (rootfs.spread_subdirs; docs/launch-figures.md)."""
    import fcntl
    import struct
    state = tmp_path / "state"
    r = dsec(*RUN, "--", "/bin/true", env={"DSEC_STATE_DIR": str(state)})
    assert r.returncode == 0, r.stderr
    sandboxes = state / "sandboxes"
    assert sandboxes.is_dir() and not list(sandboxes.iterdir())
    fs = subprocess.run(["stat", "-f", "-c", "%t", str(sandboxes)], capture_output=True, text=True).stdout.strip()
    fd = os.open(sandboxes, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = struct.unpack("l", fcntl.ioctl(fd, 0x80086601, struct.pack("l", 0)))[0]   # FS_IOC_GETFLAGS
    except OSError as e:
        flags = None
        assert fs != "ef53", e                     # ext2/3/4 have flags: only others may lack them
    finally:
        os.close(fd)
    if fs == "ef53":
        assert flags & 0x00020000, hex(flags)      # FS_TOPDIR_FL


def test_changes_manifest_kinds(tmp_path):
    r, s = run_json(tmp_path, "--user", "root", "--", "sh", "-c",
                    "rm /etc/hosts; mkdir /opt/newdir; printf abc > /opt/newdir/f; ln -s /x /opt/l")
    assert r.returncode == 0, r.stderr
    ch = {c["path"]: c for c in s["changes"]}
    assert ch["/etc/hosts"]["change"] == "deleted"
    assert ch["/opt/newdir"]["kind"] == "dir" and ch["/opt/newdir"]["change"] == "added"
    assert ch["/opt/newdir/f"]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert ch["/opt/l"]["kind"] == "symlink" and ch["/opt/l"]["target"] == "/x"


def test_memory_bomb_is_oom_killed(tmp_path):
    r, s = run_json(tmp_path, "--memory", "64M", "--", "python3", "-c",
                    "b=[]\nfor i in range(400): b.append(bytearray(4<<20))\nprint('survived')")
    assert b"survived" not in r.stdout
    assert r.returncode == 137, r.stderr
    assert s["oom_killed"] is True
    assert s["signal"] == 9
    # the host is fine: a new sandbox runs normally
    assert dsec(*RUN, "--", "true").returncode == 0


def test_fork_bomb_stopped_by_pids_limit(tmp_path):
    script = (
        "import os, time, errno\n"
        "n = 0\n"
        "for i in range(500):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print('blocked', n, errno.errorcode[e.errno]); break\n"
        "    if pid == 0:\n"
        "        time.sleep(30); os._exit(0)\n"
        "    n += 1\n"
        "else:\n"
        "    print('unbounded', n)\n")
    r, s = run_json(tmp_path, "--pids", "32", "--timeout", "60", "--", "python3", "-c", script)
    out = r.stdout.decode()
    assert out.startswith("blocked"), out + r.stderr.decode()
    n = int(out.split()[1])
    assert n < 32
    assert out.split()[2] == "EAGAIN"
    assert r.returncode == 0   # main process exits; supervisor kills the sleeping children


def test_timeout_term_then_kill(tmp_path):
    t0 = time.monotonic()
    r, s = run_json(tmp_path, "--timeout", "1", "--grace", "1", "--", "sh", "-c", "trap '' TERM; sleep 60")
    elapsed = time.monotonic() - t0
    assert r.returncode == 124
    assert s["timed_out"] is True
    assert elapsed < 1 + 1 + 5   # correctness bound (the SIGKILL came), not a benchmark
    # a workload that honours SIGTERM ends at the timeout
    r = dsec(*RUN, "--timeout", "1", "--", "sleep", "60")
    assert r.returncode == 124


def test_signal_forwarded_to_workload():
    p = subprocess.Popen([DSEC, *RUN, "--", "sh", "-c", "trap 'exit 42' TERM; echo ready; sleep 30 & wait"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 42


def test_exit_codes(tmp_path):
    assert dsec(*RUN, "--", "sh", "-c", "exit 3").returncode == 3
    r = dsec(*RUN, "--", "no-such-command-xyz")
    assert r.returncode == 127 and b"no-such-command-xyz" in r.stderr
    r = dsec(*RUN, "--", "/etc/passwd")
    assert r.returncode == 126
    assert dsec(*RUN, "--", "sh", "-c", "kill -USR1 $$").returncode == 128 + signal.SIGUSR1


@pytest.mark.parametrize("args,needle", [
    (["--bogus-option", "--", "true"], b"unrecognized arguments"),
    (["--memory", "12X", "--", "true"], b"--memory"),
    (["--rootfs", "/nonexistent/rootfs", "--", "true"], b"--rootfs"),
    ([], b"no command"),
    (["--network", "bridge", "--", "true"], b"--network"),
    (["--env", "NOEQUALS", "--", "true"], b"--env"),
    (["--sandbox-id", "../escape", "--", "true"], b"sandbox id"),
    (["--user", "nosuchuser", "--", "true"], b"--user"),
])
def test_bad_input_one_line_125(args, needle):
    r = dsec(*RUN, *args)
    assert r.returncode == 125
    err = r.stderr.decode().strip().splitlines()
    err = [line for line in err if not line.startswith("dsec: sandbox ")]
    assert len(err) == 1, err
    assert needle.decode() in err[0]
    assert "Traceback" not in r.stderr.decode()


def test_not_root_is_refused():
    r = subprocess.run([DSEC, *RUN, "--", "true"], capture_output=True, user=65534, group=65534,
                       env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert r.returncode == 125
    assert b"must run as root" in r.stderr and b"Traceback" not in r.stderr


def test_network_none_cannot_reach_host_loopback():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        r = dsec(*RUN, "--", "python3", "-c",
                 f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), 2); print('reached')\n"
                 f"except OSError as e: print('refused', e.errno)")
        assert r.stdout.startswith(b"refused"), r.stdout
        r = dsec(*RUN, "--", "sh", "-c", "ls /sys/class/net")
        assert r.stdout.split() == [b"lo"]
    finally:
        srv.close()


def test_network_egress_reaches_test_host_only_through_own_veth(sid):
    # 198.51.100.11 (TEST-NET-2) is not a node-protected range (test_boundary.py covers those)
    with NetHost(subnet=11, extra_addrs=["198.51.100.11"]) as th:
        th.serve_http(addr="0.0.0.0")
        url = "http://198.51.100.11:8080/"
        code = f"import urllib.request; print(urllib.request.urlopen('{url}', timeout=5).status)"
        r = dsec(*RUN, "--sandbox-id", sid, "--network", "egress", "--", "python3", "-c", code)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == b"200"
        # without egress the same test host is unreachable: no route at all (loopback only)
        probe = ("import socket\ntry:\n socket.create_connection(('198.51.100.11', 8080), 5); print('reached')\n"
                 "except OSError as e: print('refused', e.errno)")
        r = dsec(*RUN, "--network", "none", "--", "python3", "-c", probe)
        assert (r.returncode, r.stdout.strip()) == (0, f"refused {errno.ENETUNREACH}".encode()), (r.stdout, r.stderr)
        r = dsec(*RUN, "--network", "egress", "--", "python3", "-c", probe)       # the same probe's control
        assert (r.returncode, r.stdout.strip()) == (0, b"reached"), (r.stdout, r.stderr)
    assert not [n for n in leftovers()["links"]]


def test_50_concurrent_sandboxes_leave_nothing_behind():
    def one(i):
        return dsec(*RUN, "--sandbox-id", f"conc-{os.getpid()}-{i}", "--", "sh", "-c", "echo $HOSTNAME; echo x > /workspace/f")

    with ThreadPoolExecutor(max_workers=50) as ex:
        results = list(ex.map(one, range(50)))
    bad = [(r.returncode, r.stderr[-300:]) for r in results if r.returncode != 0]
    assert not bad, bad
    assert sorted(r.stdout.strip() for r in results) == sorted(f"conc-{os.getpid()}-{i}".encode() for i in range(50))
    mine = f"conc-{os.getpid()}-"
    lo = wait_clean(prefix=mine)
    assert not any(x for k in ("cgroups", "mounts", "state") for x in lo[k] if mine in x), lo


def test_non_utf8_arguments_and_file_names(tmp_path):
    weird = b"caf\xe9-\xff\xfe-\x80"
    code = ("import sys, os\n"
            "a = os.fsencode(sys.argv[1])\n"
            "print(a.hex())\n"
            "open(b'/workspace/' + a, 'wb').write(a)\n")
    out = tmp_path / "s.json"
    r = dsec(*RUN, "--summary-json", str(out), "--", "python3", "-c", code, weird)
    assert r.returncode == 0, r.stderr
    assert bytes.fromhex(r.stdout.decode().strip()) == weird
    s = json.loads(out.read_text())
    paths = [os.fsencode(c["path"]) for c in s["changes"]]
    assert b"/workspace/" + weird in paths


def test_environment_is_minimal_and_env_option_passes():
    r = dsec(*RUN, "--env", "FOO=bar baz", "--", "env", env={"DSEC_HOST_SECRET": "s3cret"})
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
    assert env["FOO"] == "bar baz"
    assert "DSEC_HOST_SECRET" not in env
    assert set(env) <= {"PATH", "HOME", "LANG", "HOSTNAME", "USER", "FOO"}


def test_workdir_and_dev(tmp_path):
    r = dsec(*RUN, "--workdir", "/tmp/work", "--", "sh", "-c",
             "pwd; ls /dev | tr '\\n' ' '; echo; head -c 4 /dev/urandom | wc -c; echo x > /dev/null && echo devnull-ok")
    out = r.stdout.decode().splitlines()
    assert out[0] == "/tmp/work"
    for d in ("null", "zero", "full", "random", "urandom", "tty", "pts", "shm"):
        assert d in out[1].split()
    assert out[2] == "4" and out[3] == "devnull-ok"


def test_custom_rootfs(tmp_path):
    """A rootfs directory of the test's own: dash and its libraries only."""
    rf = dash_rootfs(tmp_path / "rootfs")
    r = dsec(*RUN, "--rootfs", str(rf), "--workdir", "/", "--", "/bin/sh", "-c",
             "echo in-custom; test -e /usr/bin/python3 && echo host-visible; echo x > /tmp/t && echo tmp-ok")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == ["in-custom", "tmp-ok"]


def test_keep_upper_layer():
    sid = "keep-" + os.urandom(4).hex()
    r = dsec(*RUN, "--sandbox-id", sid, "--keep", "--", "sh", "-c", "echo kept > /workspace/k")
    assert r.returncode == 0
    kept = f"/var/lib/dsec/kept/{sid}"
    try:
        assert open(f"{kept}/_root/workspace/k").read() == "kept\n"
        assert kept.encode() in r.stderr
    finally:
        shutil.rmtree(kept)


def test_gc_after_killed_run():
    sid = "gc-" + os.urandom(4).hex()
    p = subprocess.Popen([DSEC, *RUN, "--sandbox-id", sid, "--network", "egress", "--", "sh", "-c", "echo up; sleep 60"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout.readline() == b"up\n"
    r = dsec("gc", "--dry-run")
    assert sid.encode() not in r.stdout        # live sandboxes are never touched
    p.kill()
    p.wait()
    # the supervisor notices its owner is gone and kills the workload
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and leftovers()["supervisors"]:
        time.sleep(0.05)
    r = dsec("gc")
    assert r.returncode == 0, r.stdout
    assert f"sandbox {sid}: orphaned".encode() in r.stdout
    lo = leftovers()
    assert not [c for c in lo["cgroups"] if sid in c]
    assert sid not in lo["state"]
    assert not lo["links"]
    assert dsec("gc").stdout.startswith(b"clean")


def test_gc_never_takes_a_starting_sandbox_for_an_orphan():
    """Issue 13 point 8: gc listed state directories, then cgroups; a sandbox that
    started in between had cgroups and no live state in gc's view, and gc removed
    them (and, with no sandbox live, the NAT table under it). The interleaving is
    forced: the sandbox starts right after gc's first listing."""
    from agent.sandbox import cgroups, gc
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    sid = "gcrace-" + os.urandom(4).hex()
    box = {}
    real = cgroups.list_sandbox_cgroups

    def start():
        box["sb"] = Sandbox(SandboxSpec(argv=[], sandbox_id=sid, network="none")).start()

    def listing_then_start(layout):
        t = threading.Thread(target=start)
        t.start()
        box["thread"] = t
        deadline = time.monotonic() + 3          # on main the sandbox is up well within this
        while time.monotonic() < deadline and not any(sid in c for c in leftovers()["cgroups"]):
            time.sleep(0.02)
        return real(layout)

    cgroups.list_sandbox_cgroups = listing_then_start
    try:
        rep = gc.remove(final=True)
    finally:
        cgroups.list_sandbox_cgroups = real
    box["thread"].join(30)
    sb = box.get("sb")
    assert sb is not None
    try:
        assert sid not in [s["sandbox_id"] for s in rep["sandboxes"]]
        r = sb.exec(["sh", "-c", "echo alive"], timeout=30)
        assert r.code == 0 and any(sid in c for c in leftovers()["cgroups"])
    finally:
        sb.close()


def test_kill_all_never_signals_a_pid_that_left_the_cgroup(tmp_path):
    """Issue 13 point 8: kill_all SIGKILLed the pids it read from cgroup.procs, which
    may belong to another process by then (pid reuse). A listed pid that is not a
    member any more (here: a process outside the sandbox) must survive."""
    from agent.sandbox import cgroups
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    outsider = subprocess.Popen(["sleep", "60"])
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id="kill-" + os.urandom(4).hex(), network="none")).start()
    try:
        cg = sb.cg
        real_pids = cg.pids
        calls = [0]

        def pids_with_a_stale_entry():        # the first listing has a pid that left since
            calls[0] += 1
            return sorted(set(real_pids()) | ({outsider.pid} if calls[0] == 1 else set()))
        inside = real_pids()
        assert inside and outsider.pid not in inside
        cg.pids = pids_with_a_stale_entry
        cg.kill_all(timeout=2)
        cg.pids = real_pids
        assert not real_pids()
        assert outsider.poll() is None                      # not killed
    finally:
        sb.close()
        outsider.kill()
        outsider.wait()


def test_on_gone_comes_once_nothing_of_the_sandbox_runs_and_before_on_exit():
    """close()'s on_gone hook (where the node agent ends the sensors' watch while the teardown
    goes on): called once the init is reaped and the cgroups are empty, a background process
    of a step included, and before on_exit."""
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    seen = []

    def on_gone(sid):
        seen.append(("gone", sb.supervisor_dead, sb.cg.pids(), os.path.isdir(sb.dir)))

    def on_exit(summary):
        seen.append(("exit",))
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id="gone-" + os.urandom(4).hex(), network="none"),
                 on_gone=on_gone, on_exit=on_exit).start()
    try:
        assert sb.exec(["/bin/sh", "-c", "sleep 60 & exit 0"]).exit_code == 0
        assert len(sb.cg.pids()) >= 2                  # init and the background sleep
    finally:
        sb.close()
    assert seen == [("gone", True, [], True), ("exit",)]


def test_a_closed_sandbox_s_state_leaves_at_once_and_the_trash_empties(sid, tmp_path):
    """The state directory is renamed into the trash at close and removed in the
    background (agent/sandbox/trash.py): gone from the sandboxes at once, its id free
    for the next sandbox, nothing left once the thread is done; gc's sweep empties a
    trash that a crash left."""
    from agent.sandbox import launcher, trash
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id=sid)).start()
    assert sb.exec(["sh", "-c", "echo x > /workspace/f"]).exit_code == 0
    sb.close()
    assert not os.path.exists(os.path.join(launcher.SANDBOX_DIR, sid))
    again = Sandbox(SandboxSpec(argv=[], sandbox_id=sid)).start()      # the same id, at once
    again.close()
    assert trash.drain(30)
    tdir = trash.trash_dir(launcher.SANDBOX_DIR)
    assert os.stat(tdir).st_mode & 0o777 == 0o700
    assert not [n for n in os.listdir(tdir) if n.startswith(sid + "-")]
    left = tmp_path / "trash" / "sbx-crashed-1234"
    (left / "upper" / "_root").mkdir(parents=True)
    (left / "upper" / "_root" / "f").write_text("x")
    assert trash.sweep(str(tmp_path / "sandboxes")) == [str(left)]
    assert not left.exists()


DEEP_TREE = """
import os
os.chdir("/workspace")
for i in range(2500):                     # deeper than Python's recursion limit and than PATH_MAX
    os.mkdir("d"); os.chdir("d")
open("leaf", "w").close()
"""


def test_a_tree_deeper_than_the_recursion_limit_is_listed_and_removed(sid):
    """A workload's 2,500-deep directory chain (one mkdir + chdir loop): on main the close's
    change manifest raised RecursionError (os.walk) and the trash thread died on it
    (shutil.rmtree), leaving this and every later sandbox's state directory behind. Now the
    manifest lists what it can reach and says where it stopped; the tree is removed."""
    from agent.sandbox import launcher, trash
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id=sid)).start()
    try:
        r = sb.exec(["python3", "-I", "-c", DEEP_TREE], timeout=120)
    finally:
        summary = sb.close()
    assert r.exit_code == 0, r.error
    deep = [c for c in summary["changes"] if "not_walked" in c]
    assert len(deep) == 1 and deep[0]["path"].startswith("/workspace/d/d/"), deep
    assert summary["changes_truncated"] is True
    walked = [c for c in summary["changes"] if c["path"].startswith("/workspace/d")]
    assert len(walked) > 1000                       # every level down to where paths get too long
    assert trash.drain(60)
    tdir = trash.trash_dir(launcher.SANDBOX_DIR)
    assert not [n for n in os.listdir(tdir) if n.startswith(sid + "-")]
    after = Sandbox(SandboxSpec(argv=[], sandbox_id=sid)).start()      # the thread still removes
    after.close()
    assert trash.drain(30)
    assert not [n for n in os.listdir(tdir) if n.startswith(sid + "-")]


def test_the_manifest_hashes_within_a_budget(sid):
    """Twelve sparse 1 GiB files (no disk used): on main the close read all 12 GiB to hash
    them (a thousand would have kept the agent's close busy for minutes); now the manifest
    hashes 1 GiB in all and says, for each file it did not hash, why."""
    from agent.sandbox import rootfs
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id=sid)).start()
    try:
        r = sb.exec(["sh", "-c", "cd /workspace && echo small > a.txt && "
                                 "for i in $(seq 12); do truncate -s 1G f$i || exit 1; done"], timeout=60)
    finally:
        summary = sb.close()
    assert r.exit_code == 0, r.error
    ch = {c["path"]: c for c in summary["changes"]}
    assert ch["/workspace/a.txt"]["sha256"] == hashlib.sha256(b"small\n").hexdigest()
    big = [ch[f"/workspace/f{i}"] for i in range(1, 13)]
    assert all(c["size"] == 1 << 30 for c in big)
    skipped = [c for c in big if c["sha256"] is None]
    assert len(skipped) == 12 and all("hashing budget" in c["sha256_skipped"] for c in skipped), big[:2]
    assert rootfs.MAX_HASH_TOTAL == 1 << 30


def test_an_egress_sandbox_s_link_goes_off_the_close_s_path_and_its_id_waits(sid):
    """teardown_later (the node agent's): an egress sandbox's host link is removed by
    trash.py's thread after close returns. Until then the sandbox is live to gc (its state
    dir locked, its link not a stray) and a new start of its id waits; then both are gone.
    The thread is held by a job queued first, so the order is the test's, not a race."""
    from agent.sandbox import gc, netns, trash
    from agent.sandbox.launcher import SANDBOX_DIR, Sandbox, SandboxSpec
    hold, held = threading.Event(), threading.Event()
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id=sid, network="egress"))
    sb.teardown_later = True
    sb.start()
    host_if = netns.ifnames(sid)[0]
    again = None
    try:
        assert sb.exec(["/bin/true"]).exit_code == 0
        trash.later("test-hold", lambda: (held.set(), hold.wait(30)))
        assert held.wait(30)
        sb.close()
        assert os.path.exists(f"/sys/class/net/{host_if}") and os.path.isdir(os.path.join(SANDBOX_DIR, sid))
        found = gc.collect()
        assert sid in found["live"] and host_if not in found["links"] and sid not in found["orphans"]
        with ThreadPoolExecutor(1) as ex:
            started = ex.submit(lambda: Sandbox(SandboxSpec(argv=[], sandbox_id=sid, network="egress")).start())
            time.sleep(0.3)
            assert not started.done()                   # waits for the first one's teardown
            hold.set()
            again = started.result(60)
        assert again.exec(["/bin/true"]).exit_code == 0
    finally:
        hold.set()
        if again is not None:
            again.close()
        assert trash.drain(60)
    assert not os.path.exists(f"/sys/class/net/{host_if}")
    assert not os.path.exists(os.path.join(SANDBOX_DIR, sid))


def test_manifest_leaves_out_what_dsec_seeded_and_reads_it_only_if_changed(tmp_path):
    """The default user's passwd and group entries that dsec writes into the upper layer are
    not changes of the workload; the manifest takes their hash from the seeding when the
    file's inode, ctime and size are as written, and reads a file again otherwise."""
    r, s = run_json(tmp_path, "--", "sh", "-c", "echo hi > /workspace/out")
    assert r.returncode == 0, r.stderr
    paths = {c["path"] for c in s["changes"]}
    assert "/workspace/out" in paths
    assert not paths & {"/etc/passwd", "/etc/group", "/etc", "/workspace"}, paths

    from agent.sandbox import rootfs
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    (upper / "etc").mkdir(parents=True)
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    f = upper / "etc" / "passwd"
    f.write_text("sandbox:x:1:1::/:/bin/sh\n")
    st = os.stat(f)
    known = {str(f): (st.st_ino, st.st_ctime_ns, st.st_size, "0" * 64)}
    ch, _ = rootfs.changes([("/", str(upper), str(lower))], known=known)
    assert {c["path"]: c.get("sha256") for c in ch}["/etc/passwd"] == "0" * 64     # not read again
    time.sleep(0.01)
    f.write_text("sandbox:x:2:2::/:/bin/sh\n")        # the same size, written: its ctime moved
    ch, _ = rootfs.changes([("/", str(upper), str(lower))], known=known)
    assert {c["path"]: c.get("sha256") for c in ch}["/etc/passwd"] == \
        hashlib.sha256(b"sandbox:x:2:2::/:/bin/sh\n").hexdigest()
