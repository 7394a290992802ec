"""Policy enforcement on the real kernel (bpf/enforce.c, agent/sensors/enforce.py):
egress (cgroup connect/sendmsg hooks), exec allowlist (killed at
sched_process_exec), syscall violations (raw_syscalls), learn mode, and the
fail-closed property: the loading process SIGKILLed leaves the denials in force.

Network tests run their workloads in a network namespace of the test's own
whose only link is a veth to a second namespace of the test's own
(fixtures_enforce.TestNet): no packet can leave the machine even if
enforcement is broken.

Why this file is long: the tests share one compiled sensor for the session
(enforce_sensor: one BCC compile); split into files they would compile it
once per file."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.sensors import bpfsys
from agent.sensors.enforce import (EGRESS_PROGS, EnforcementSensor, check_features, egress_table, gc_stale_pins,
                                  require_features)
from agent.errors import DsecError
from agent.sensors.resolver import HostResolver, build_query, parse_response
from audit_schema.events import FIELD_NAMES, KINDS
from fixtures_enforce import PYTHON, TEST_PIN_ROOT, DnsServer, run_workload
from fixtures_enforce import enforce_cgroups, enforce_net, enforce_sensor  # noqa: F401 (fixtures)
from policies.compile import egress_rules
from policies.load import policy_from_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NETCLIENT = r'''
import errno, json, socket, sys
out = []
for proto, addr, port in json.loads(sys.argv[1]):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM if proto.startswith("tcp") else socket.SOCK_DGRAM)
    try:
        if proto == "tcp":
            s.settimeout(5)
            s.connect((addr, port))
            r = "ok"
        elif proto == "tcpnb":                 # non-blocking: EPERM or "started"
            s.setblocking(False)
            e = s.connect_ex((addr, port))
            r = "EPERM" if e == errno.EPERM else "ok"
        else:
            s.sendto(b"x", (addr, port))
            r = "ok"
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()
    out.append(r)
print(json.dumps(out), flush=True)
'''


def policy(mode="enforce", name="t-enforce", **spec):
    spec = {"mode": mode, **spec}
    return policy_from_data({"apiVersion": "dsec/v1", "kind": "SandboxPolicy", "metadata": {"name": name},
                             "spec": spec}, f"<{name}>")


def net_actions(cg, net, actions, timeout=60):
    p = run_workload(cg, [PYTHON, "-I", "-c", NETCLIENT, json.dumps(actions)], netns=net.client,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode()
    return json.loads(out)


def _extra(rec) -> dict:
    return json.loads(rec["extra"]) if rec["extra"] else {}


# ---------------------------------------------------------------- features, pure parts

def test_features_present():
    assert check_features(pin_root=TEST_PIN_ROOT) == []


def test_missing_features_are_one_clear_line(tmp_path):
    with pytest.raises(DsecError) as e:
        require_features(tracefs_roots=(str(tmp_path / "nowhere"),), pin_root=str(tmp_path / "pins"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("eBPF enforcement unavailable: ")
    assert "tracefs not mounted" in msg and f"no bpf filesystem at {tmp_path / 'pins'}" in msg


def test_schema_knows_the_enforcement_kinds():
    for k in ("egress_denied", "egress_violation", "exec_denied", "exec_violation", "syscall_denied",
              "syscall_violation"):
        assert k in KINDS
    assert {"syscall", "protocol", "decision"} <= set(FIELD_NAMES)


def test_egress_table_unions_covering_rules():
    p = policy(egress={"default": "deny", "dns": ["10.0.0.2"], "allow": [
        {"cidr": "10.0.0.0/8", "ports": [443], "protocol": "tcp"},
        {"cidr": "10.1.0.0/16", "ports": ["80-90"], "protocol": "udp"},
        {"cidr": "::ffff:192.168.0.0/112", "ports": [22]}]})
    t = egress_table(egress_rules(p))
    n = ipaddress.ip_network
    assert t[n("10.0.0.0/8")] == ((443, 443, 1),)
    assert t[n("10.1.0.0/16")] == ((80, 90, 2), (443, 443, 1))   # the /8's rule covers it too
    assert t[n("10.0.0.2/32")] == ((53, 53, 7), (443, 443, 1))    # the resolver
    assert t[n("192.168.0.0/16")] == ((22, 22, 7),)               # IPv4-mapped: checked as IPv4


def test_resolver_wire_format_round_trip():
    srv = DnsServer({"svc.dsec.test": (["10.9.8.7", "10.9.8.6"], 42)})
    try:
        r = HostResolver(nameservers=[srv.addr], hosts_file="/nonexistent", system_fallback=False)
        res = r.resolve("SVC.dsec.test.")
        assert res.addresses == ("10.9.8.6", "10.9.8.7") and res.ttl == 42 and res.source == "dns"
        assert r.resolve("other.dsec.test").addresses == ()
    finally:
        srv.close()
    q = build_query("a.b", 1, 7)
    with pytest.raises(Exception, match="does not match"):
        parse_response(q[:2] + b"\x80\x00" + q[4:], 8, 1)


# ---------------------------------------------------------------- egress

def test_egress_enforce_then_audit(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    rules = {"default": "deny", "dns": [net.server_addr],
             "allow": [{"cidr": f"{net.server_addr}/32", "ports": [80], "protocol": "tcp"}]}
    actions = [
        ("tcp", net.server_addr, 80),          # allowed host
        ("tcp", net.addr(3), 80),              # its sibling in the same /24
        ("tcp", "169.254.169.254", 80),        # metadata address (served by the test's own netns)
        ("tcp", net.server_addr, 443),         # allowed host, other port
        ("udp", net.server_addr, 53),          # the resolver
        ("tcp", net.server_addr, 53),          # the resolver over TCP
        ("udp", net.addr(3), 53),              # DNS to a non-resolver
        ("udp", net.server_addr, 80),          # allowed host, wrong protocol
        ("tcp", "::ffff:" + net.addr(3), 80),  # the sibling, IPv4-mapped on an IPv6 socket
        ("tcp", "::ffff:" + net.server_addr, 80),
    ]
    denied = [1, 2, 3, 6, 7, 8]
    results = {}
    for mode in ("enforce", "audit"):
        pol = policy(mode, egress=rules)
        sbx = h.sandbox(enforce_cgroups, pol)
        got = net_actions(sbx.cg, net, actions)
        h.settle()
        results[mode] = (pol, sbx, got)
    pol_e, sbx_e, got_e = results["enforce"]
    pol_a, sbx_a, got_a = results["audit"]

    # enforce: EPERM for exactly the denied ones, the others work
    assert got_e == ["EPERM" if i in denied else "ok" for i in range(len(actions))], got_e
    recs = sbx_e.of_kind("egress_denied", "egress_violation")
    assert [r["kind"] for r in recs] == ["egress_denied"] * len(denied)       # exactly one per denial
    want = [(("ipv4"), actions[i][1].removeprefix("::ffff:"), actions[i][2],
             "tcp" if actions[i][0] == "tcp" else "udp") for i in denied]
    assert [(r["family"], r["addr"], r["port"], r["protocol"]) for r in recs] == want
    for r in recs:
        assert r["decision"] == "denied" and r["ret"] == -1 and r["mode"] == "enforce"
        assert r["policy_name"] == "t-enforce" and r["policy_hash"] == pol_e.hash
        assert r["sandbox_id"] == sbx_e.sandbox_id and r["pid"] > 0 and r["comm"] == "python3"
        assert set(r) == set(FIELD_NAMES)
    assert [_extra(r)["hook"] for r in recs] == ["connect4"] * 3 + ["sendmsg4"] * 2 + ["connect6"]
    assert _extra(recs[-1])["status"] == ["ipv4_mapped"]

    # audit: the same rules (same hash) let everything through, each would-deny reported once
    assert got_a == ["ok"] * len(actions), got_a
    assert pol_a.hash == pol_e.hash
    recs_a = sbx_a.of_kind("egress_denied", "egress_violation")
    assert [r["kind"] for r in recs_a] == ["egress_violation"] * len(denied)
    assert [(r["family"], r["addr"], r["port"], r["protocol"]) for r in recs_a] == want
    assert all(r["decision"] == "would-deny" and r["mode"] == "audit" and r["ret"] == 0 for r in recs_a)
    assert sbx_e.remove()["lost_total"] == 0 and sbx_a.remove()["lost_total"] == 0


def test_kernel_decisions_match_the_policy_model(enforce_sensor, enforce_cgroups, enforce_net):
    """Overlapping networks, port ranges and protocols: the kernel decides as
    policies.compile.EgressRules.decide() does (default deny and default allow)."""
    h, net = enforce_sensor, enforce_net
    pre = net.prefix
    probes = [(proto, pre + str(host), port) for proto in ("tcpnb", "udp") for host in (2, 4, 5, 7, 9, 200)
              for port in (53, 80, 999, 1000, 1500, 2000, 2001)]
    for default, lst in (("deny", "allow"), ("allow", "deny")):
        spec = {"default": default, lst: [
            {"cidr": pre + "0/24", "ports": [80], "protocol": "tcp"},
            {"cidr": pre + "4/30", "ports": ["1000-2000"]},
            {"cidr": pre + "5/32", "ports": [53], "protocol": "udp"},
            {"cidr": pre + "9/32"}]}
        if default == "deny":
            spec["dns"] = [pre + "2"]
        pol = policy("enforce", egress=spec)
        model = egress_rules(pol)
        sbx = h.sandbox(enforce_cgroups, pol)
        got = net_actions(sbx.cg, net, probes)
        want = ["EPERM" if model.decide(a, port, "tcp" if proto == "tcpnb" else "udp") == "deny" else "ok"
                for proto, a, port in probes]
        assert got == want, [(p, g, w) for p, g, w in zip(probes, got, want) if g != w]
        h.settle()
        assert len(sbx.of_kind("egress_denied")) == want.count("EPERM")


def test_hostname_rules_follow_dns_ttl(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    dns = DnsServer({"svc.dsec.test": ([net.addr(5)], 1)})
    saved = h.sensor.resolver
    h.sensor.resolver = HostResolver(nameservers=[dns.addr], min_ttl=1, hosts_file="/nonexistent",
                                     system_fallback=False)
    try:
        pol = policy(egress={"default": "deny", "dns": [net.server_addr],
                             "allow": [{"host": "svc.dsec.test", "ports": [80], "protocol": "tcp"}]})
        sbx = h.sandbox(enforce_cgroups, pol)
        a5, a6 = ("tcp", net.addr(5), 80), ("tcp", net.addr(6), 80)
        assert h.sensor.egress_addresses(sbx.cg.id) == {"svc.dsec.test": [net.addr(5)]}
        assert net_actions(sbx.cg, net, [a5, a6]) == ["ok", "EPERM"]
        dns.answers["svc.dsec.test"] = ([net.addr(6)], 1)       # the name moves
        time.sleep(1.1)
        h.sensor.poll(10)                                         # due: re-resolved from poll()
        assert set(h.sensor.egress_addresses(sbx.cg.id)["svc.dsec.test"]) == {net.addr(5), net.addr(6)}
        assert net_actions(sbx.cg, net, [a5, a6]) == ["ok", "ok"]  # the old one for one more TTL
        time.sleep(2.1)
        h.sensor.refresh_hosts(force=True)
        assert h.sensor.egress_addresses(sbx.cg.id) == {"svc.dsec.test": [net.addr(6)]}
        assert net_actions(sbx.cg, net, [a5, a6]) == ["EPERM", "ok"]
        dns.close()                                               # resolver down: last answer kept
        h.sensor.refresh_hosts(force=True)
        assert h.sensor.egress_addresses(sbx.cg.id) == {"svc.dsec.test": [net.addr(6)]}
        assert any("cannot resolve 'svc.dsec.test'" in w for w in h.sensor.warnings)
    finally:
        h.sensor.resolver = saved
        dns.close()


def test_update_egress_takes_effect_at_once(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    rule = lambda host: {"default": "deny", "allow": [{"cidr": f"{net.addr(host)}/32", "ports": [80]}]}  # noqa: E731
    sbx = h.sandbox(enforce_cgroups, policy(egress=rule(2)))
    acts = [("tcp", net.addr(2), 80), ("tcp", net.addr(3), 80)]
    assert net_actions(sbx.cg, net, acts) == ["ok", "EPERM"]
    p2 = policy(name="t-enforce-2", egress=rule(3))
    h.sensor.update_egress(sbx.cg.id, p2)
    assert net_actions(sbx.cg, net, acts) == ["EPERM", "ok"]
    h.settle()
    last = sbx.of_kind("egress_denied")[-1]
    assert (last["addr"], last["policy_name"], last["policy_hash"]) == (net.addr(2), "t-enforce-2", p2.hash)
    with pytest.raises(DsecError, match="changes more than egress rules"):
        h.sensor.update_egress(sbx.cg.id, policy(egress=rule(3), exec={"allow": ["/usr/bin/true"]}))
    with pytest.raises(DsecError, match="changes more than egress rules"):
        h.sensor.update_egress(sbx.cg.id, policy("audit", egress=rule(3)))


def test_a_denial_flood_is_counted_never_silent(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    sbx = h.sandbox(enforce_cgroups, policy(egress={"default": "deny"}), rate=100, burst=10)
    n = 2000
    got = net_actions(sbx.cg, net, [("udp", net.addr(3), 9)] * n)
    assert got == ["EPERM"] * n
    totals = sbx.remove()
    emitted = totals["emitted"]["egress_denied"]
    over = totals["lost"]["over_budget"]["egress_denied"]
    assert emitted + over == n and emitted >= 10 and over > 0
    assert len(sbx.of_kind("egress_denied")) == emitted
    lost = sbx.of_kind("events_lost")
    assert sum(r["count"] for r in lost) == over
    assert {_extra(r)["reason"] for r in lost} == {"over_budget"}


# ---------------------------------------------------------------- exec

EXEC_WORKLOAD = r'''
import json, os, subprocess, sys
d = sys.argv[1]
def run(argv, cwd=None):
    try:
        return subprocess.run(argv, cwd=cwd).returncode
    except OSError as e:
        return "error:" + e.strerror
out = {
    "true": run(["/usr/bin/true"]),
    "touch": run(["/usr/bin/touch", d + "/marker-touch"]),
    "script": run([d + "/marker.sh"]),
    "truncate": run(["/usr/bin/truncate", "-s", "0", d + "/marker-truncate"]),
    # relative: joined to the cwd verified at the child's chdir (issue 21)
    "relative": run(["./truncate", "-s", "0", d + "/marker-rel"], cwd="/usr/bin"),
    "relative_ok": run(["./true"], cwd="/usr/bin"),
    "symlink": run([d + "/truelink"]),
}
print(json.dumps(out), flush=True)
'''


def _exec_setup(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    script = d / "marker.sh"
    script.write_text(f"#!/bin/sh\necho ran > {d}/marker-script\n")
    script.chmod(0o755)
    os.symlink("/usr/bin/true", d / "truelink")
    return str(d)


def test_exec_allowlist_enforce_and_audit(enforce_sensor, enforce_cgroups, tmp_path):
    h = enforce_sensor
    d = _exec_setup(tmp_path)
    allow = {"allow": ["/usr/bin/python3*", "/usr/bin/true"]}
    pol = policy(exec=allow)
    sbx = h.sandbox(enforce_cgroups, pol)
    p = run_workload(sbx.cg, [PYTHON, "-I", "-c", EXEC_WORKLOAD, d], stdout=subprocess.PIPE)
    got = json.loads(p.communicate(timeout=60)[0])
    assert p.returncode == 0
    # killed by SIGKILL at exec: nothing of the new image ran, no marker written
    assert got == {"true": 0, "touch": -9, "script": -9, "truncate": -9, "relative": -9, "relative_ok": 0,
                   "symlink": -9}, got
    assert not [f for f in os.listdir(d) if f.startswith("marker-")]
    h.settle()
    recs = sbx.of_kind("exec_denied", "exec_violation")
    paths = [r["path_raw"] for r in recs]
    assert paths == ["/usr/bin/touch", f"{d}/marker.sh", "/usr/bin/truncate", "./truncate", f"{d}/truelink"]
    assert all(r["kind"] == "exec_denied" and r["decision"] == "denied" and r["signal"] == 9 for r in recs)
    assert [r["comm"] for r in recs][:1] == ["touch"]
    rel = recs[3]
    assert set(_extra(rel)["status"]) == {"not_absolute", "cwd_joined"}, _extra(rel)
    assert rel["path"] == "/usr/bin/truncate" and _extra(rel)["cwd"] == "/usr/bin", rel
    assert h.sensor.stats(sbx.cg.id)["killed"] == 5

    # audit: the same allowlist only reports; everything runs
    sbx_a = h.sandbox(enforce_cgroups, policy("audit", exec=allow))
    for f in os.listdir(d):
        if f.startswith("marker-"):
            os.unlink(os.path.join(d, f))
    p = run_workload(sbx_a.cg, [PYTHON, "-I", "-c", EXEC_WORKLOAD, d], stdout=subprocess.PIPE)
    got = json.loads(p.communicate(timeout=60)[0])
    assert got == {"true": 0, "touch": 0, "script": 0, "truncate": 0, "relative": 0, "relative_ok": 0,
                   "symlink": 0}, got
    assert sorted(f for f in os.listdir(d) if f.startswith("marker-")) == [
        "marker-rel", "marker-script", "marker-touch", "marker-truncate"]
    h.settle()
    recs = sbx_a.of_kind("exec_denied", "exec_violation")
    assert [r["path_raw"] for r in recs] == paths
    assert all(r["kind"] == "exec_violation" and r["decision"] == "would-deny" and r["signal"] == 0
               for r in recs)
    assert h.sensor.stats(sbx_a.cg.id)["killed"] == 0


def test_exec_pattern_too_long_for_the_kernel_is_refused(enforce_sensor, enforce_cgroups):
    long = "/" + "a" * 251
    with pytest.raises(DsecError, match="at most 250"):
        enforce_sensor.sandbox(enforce_cgroups, policy(exec={"allow": [long]}))


# ---------------------------------------------------------------- syscalls

SYSCALL_WORKLOAD = r'''
import ctypes, json, sys
sys.path.insert(0, sys.argv[2])
from policies.compile import seccomp_filter
from policies.load import policy_from_data
pol = policy_from_data(json.loads(sys.argv[1]))
libc = ctypes.CDLL(None, use_errno=True)
seccomp_filter(pol).load()                      # as the launcher does before CMD
errs = set()
for _ in range(1000):
    libc.ptrace(0x4206, -1, 0, 0)               # PTRACE_SEIZE of no process: harmless
    errs.add(ctypes.get_errno())
libc.mount(b"none", b"/nonexistent-dsec", b"tmpfs", 0, None)
errs.add(ctypes.get_errno())
print(json.dumps(sorted(errs)), flush=True)
'''


def test_syscall_violations_reported_once_with_counts(enforce_sensor, enforce_cgroups):
    h = enforce_sensor
    spec = {"syscalls": {"default": "allow", "deny": ["ptrace", "mount"]}}
    out = {}
    for mode in ("enforce", "audit"):
        pol = policy(mode, **spec)
        sbx = h.sandbox(enforce_cgroups, pol)
        data = pol.to_dict()
        p = run_workload(sbx.cg, [sys.executable, "-I", "-c", SYSCALL_WORKLOAD, json.dumps(data), ROOT],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        o, e = p.communicate(timeout=60)
        assert p.returncode == 0, e.decode()
        h.settle()
        out[mode] = (sbx, json.loads(o), h.sensor.stats(sbx.cg.id), sbx.remove())
    for mode, kind, decision in (("enforce", "syscall_denied", "denied"), ("audit", "syscall_violation",
                                                                           "would-deny")):
        sbx, errnos, stats, totals = out[mode]
        assert stats["violations"] == {"ptrace": 1000, "mount": 1}
        recs = sbx.of_kind("syscall_denied", "syscall_violation")
        assert {r["kind"] for r in recs} == {kind} and {r["decision"] for r in recs} == {decision}
        by = {}
        for r in recs:
            by.setdefault(r["syscall"], []).append(r)
        assert set(by) == {"ptrace", "mount"}
        # not one record per call: the first at once, the rest counted
        assert 1 <= len(by["ptrace"]) <= 3 and sum(r["count"] for r in by["ptrace"]) == 1000
        assert by["ptrace"][0]["count"] == 1 and _extra(by["ptrace"][0])["total"] == 1
        assert [r["count"] for r in by["mount"]] == [1]
        assert all(_extra(r)["nr"] == {"ptrace": 101, "mount": 165}[r["syscall"]] for r in recs)
        if mode == "enforce":
            assert errnos == [1]                              # EPERM from seccomp
            assert all(r["ret"] == -1 and _extra(r)["action"] == "errno" for r in recs)
        else:
            assert 1 not in errnos                             # ran (and failed on their own)
            assert all(r["ret"] == 0 for r in recs)
        assert totals["lost_total"] == 0


def _common_bit(sensor, nr: int, table: bytes = b"sys_common") -> bool:
    t = sensor.bpf[table]
    return bool((t[t.Key(nr // 64)].value >> (nr % 64)) & 1)


@pytest.mark.parametrize("mode", ["enforce", "audit"])
def test_a_call_allowed_next_door_is_still_denied_and_reported(enforce_sensor, enforce_cgroups, mode):
    """The syscall programs return at once for a call that every sandbox of
    their mode allows (bpf/enforce.c sys_common: enforce mode's sys_exit;
    sys_common_audit: audit mode's sys_enter). Sandbox A allows ptrace and is
    registered first; B, registered after it, denies ptrace: B's calls are
    reported (and in enforce mode refused), and once B is gone ptrace is
    common again. A learn-mode sandbox, which counts every call, leaves
    nothing common at entry while it is registered."""
    h = enforce_sensor
    ptrace, mount = 101, 165
    table = b"sys_common" if mode == "enforce" else b"sys_common_audit"
    kind = "syscall_denied" if mode == "enforce" else "syscall_violation"
    a = h.sandbox(enforce_cgroups, policy(mode, syscalls={"default": "allow", "deny": ["mount"]}))
    try:
        assert _common_bit(h.sensor, ptrace, table) and not _common_bit(h.sensor, mount, table)
        pol = policy(mode, syscalls={"default": "allow", "deny": ["ptrace", "mount"]})
        b = h.sandbox(enforce_cgroups, pol)
        assert not _common_bit(h.sensor, ptrace, table)
        p = run_workload(b.cg, [sys.executable, "-I", "-c", SYSCALL_WORKLOAD, json.dumps(pol.to_dict()), ROOT],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        o, e = p.communicate(timeout=60)
        assert p.returncode == 0, e.decode()
        errnos = json.loads(o)
        assert errnos == [1] if mode == "enforce" else 1 not in errnos      # EPERM from seccomp
        h.settle()
        assert h.sensor.stats(b.cg.id)["violations"] == {"ptrace": 1000, "mount": 1}
        b.remove()
        assert sum(r["count"] for r in b.of_kind(kind) if r["syscall"] == "ptrace") == 1000
        assert _common_bit(h.sensor, ptrace, table) and not _common_bit(h.sensor, mount, table)
        if mode == "enforce":   # socket, socketpair, clone, unshare: their exits always checked
            assert not any(_common_bit(h.sensor, nr) for nr in (41, 53, 56, 272))
        else:
            learner = h.sandbox(enforce_cgroups, policy("learn"))
            assert not any(_common_bit(h.sensor, nr, table) for nr in range(512))
            learner.remove()
            assert _common_bit(h.sensor, ptrace, table)
    finally:
        a.remove()


NS_CLONE_WORKLOAD = r'''
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[2])
from policies.compile import seccomp_filter
from policies.load import policy_from_data
seccomp_filter(policy_from_data(json.loads(sys.argv[1]))).load()
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)     # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
print(json.dumps(pid > 0 and os.waitpid(pid, 0)[1] == 0), flush=True)
'''


def test_audit_mode_reports_a_namespace_clone(enforce_sensor, enforce_cgroups):
    """Audit mode with `namespaces: deny`: seccomp logs a namespace-creating
    clone and lets it run; syscalls:sys_enter_clone, attached while such a
    sandbox is registered, reports it (would-deny, status namespaces)."""
    h = enforce_sensor
    pol = policy("audit", syscalls={"default": "allow", "namespaces": "deny"})
    sbx = h.sandbox(enforce_cgroups, pol)
    assert h.sensor.syscall_hooks()["clone"]["attached"]
    p = run_workload(sbx.cg, [sys.executable, "-I", "-c", NS_CLONE_WORKLOAD, json.dumps(pol.to_dict()), ROOT],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    o, e = p.communicate(timeout=60)
    assert p.returncode == 0 and json.loads(o) is True, e.decode()
    h.settle()
    sbx.remove()
    recs = [r for r in sbx.of_kind("syscall_violation") if r["syscall"] == "clone"]
    assert recs and all("namespaces" in _extra(r)["status"] and r["decision"] == "would-deny" for r in recs), recs


LEARN_WORKLOAD = r'''
import ctypes, json, os, socket, subprocess, sys
sys.stdin.readline()
libc = ctypes.CDLL(None, use_errno=True)
for _ in range(int(sys.argv[1])):
    libc.syscall(110)                             # getppid(2)
if len(sys.argv) > 2:
    subprocess.run(["/usr/bin/true"])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", (sys.argv[2], 53))
    c = socket.socket()
    c.settimeout(5)
    c.connect((sys.argv[2], 80))
print("done", flush=True)
'''


def test_learn_mode_counts_in_the_kernel(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    pol = policy("learn", syscalls={"default": "allow", "deny": ["ptrace"]},
                 egress={"default": "deny"})
    cg = enforce_cgroups()
    # the "supervisor": in the cgroup before registration, exempt with its children until they exec
    sup = run_workload(cg, [PYTHON, "-I", "-c", LEARN_WORKLOAD, "300", net.server_addr], netns=net.client,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sbx = h.sandbox(enforce_cgroups, pol, cg=cg, exempt_pids=[sup.pid])
    work = run_workload(cg, [PYTHON, "-I", "-c", LEARN_WORKLOAD, "500"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE)
    for p in (sup, work):
        p.stdin.write(b"\n")
        p.stdin.close()
        assert p.stdout.readline() == b"done\n"
        assert p.wait(30) == 0
    counts = h.sensor.syscall_counts(sbx.cg.id)
    # the workload's 500 getppid; not the exempt process's 300; /usr/bin/true (exec'd by
    # the exempt process) is the workload again: its exit_group counts
    assert counts["getppid"] == 500, counts
    assert counts["exit_group"] >= 2 and counts["execve"] >= 1
    assert "ptrace" not in counts
    dests = h.sensor.egress_destinations(sbx.cg.id)
    got = {(d["addr"], d["port"], d["protocol"], d["hook"]) for d in dests}
    assert got == {(net.server_addr, 53, "udp", "sendmsg4"), (net.server_addr, 80, "tcp", "connect4")}
    assert all(d["count"] == 1 for d in dests)
    h.settle()
    assert not sbx.of_kind("egress_denied", "egress_violation", "syscall_denied", "syscall_violation")
    totals = sbx.remove()
    assert totals["syscalls"]["getppid"] == 500 and len(totals["destinations"]) == 2
    with pytest.raises(DsecError, match="not enforced"):
        h.sensor.syscall_counts(sbx.cg.id)


# ---------------------------------------------------------------- fail closed

LOADER = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from agent.sensors.enforce import EnforcementSensor
from policies.load import policy_from_data
cgid, path, pin_root, pol = int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
s = EnforcementSensor(pin_root=pin_root)
s.add_sandbox(cgid, path, "sbx-persist", policy_from_data(pol))
print(s.pin_dir, flush=True)
time.sleep(600)
'''

PERSIST_WORKLOAD = r'''
import errno, json, socket, subprocess, sys
out = {}
for name, addr in (("allowed", sys.argv[1]), ("sibling", sys.argv[2])):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((addr, 80))
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
    s.close()
out["true"] = subprocess.run(["/usr/bin/true"]).returncode
out["touch"] = subprocess.run(["/usr/bin/touch", sys.argv[3]]).returncode
print(json.dumps(out), flush=True)
'''


def test_sigkilled_loader_leaves_the_denials_in_force(enforce_sensor, enforce_cgroups, enforce_net, tmp_path):
    h, net = enforce_sensor, enforce_net
    pin_root = "/sys/fs/bpf/dsec-test-persist"
    cg = enforce_cgroups()
    spec = {"egress": {"default": "deny", "allow": [{"cidr": f"{net.server_addr}/32", "ports": [80]}]},
            "exec": {"allow": ["/usr/bin/python3*", "/usr/bin/true"]}}
    loader = subprocess.Popen([sys.executable, "-c", LOADER, ROOT, str(cg.id), cg.path, pin_root,
                               json.dumps(policy(**spec).to_dict())], stdout=subprocess.PIPE)
    marker = str(tmp_path / "marker")

    def workload():
        p = run_workload(cg, [PYTHON, "-I", "-c", PERSIST_WORKLOAD, net.server_addr, net.addr(3), marker],
                         netns=net.client, stdout=subprocess.PIPE)
        return json.loads(p.communicate(timeout=60)[0])

    try:
        pin_dir = loader.stdout.readline().decode().strip()
        # the exec check, and the cwd tracking its relative execs rely on (issue 21)
        from agent.sensors.enforce import CWD_MAP_PINS, PINNED_TPS
        assert pin_dir.startswith(pin_root + "/enf-")
        assert sorted(os.listdir(pin_dir)) == sorted(["exec"] + [ev for _, ev in PINNED_TPS] + list(CWD_MAP_PINS))
        assert workload() == {"allowed": "ok", "sibling": "EPERM", "true": 0, "touch": -9}
        loader.send_signal(signal.SIGKILL)
        assert loader.wait(10) == -9
        # the agent is dead: the cgroup's programs (legacy attach) and the pinned exec link live on
        fd = os.open(cg.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _, atype in EGRESS_PROGS:
                assert len(bpfsys.prog_query(fd, atype)) == 1
        finally:
            os.close(fd)
        assert workload() == {"allowed": "ok", "sibling": "EPERM", "true": 0, "touch": -9}
        assert not os.path.exists(marker)

        # a new agent re-adopts the sandbox (here: in audit mode); the old programs go
        sbx = h.sandbox(enforce_cgroups, policy("audit", **spec), cg=cg)
        assert h.sensor.stats(cg.id)["adopted"] == 4
        got = workload()
        assert (got["sibling"], got["touch"]) == ("ok", -9)    # the old exec link still runs ...
        assert gc_stale_pins(pin_root) == [pin_dir]            # ... until the stale pin is collected
        assert workload() == {"allowed": "ok", "sibling": "ok", "true": 0, "touch": 0}
        assert os.path.exists(marker)
        h.settle()
        kinds = [r["kind"] for r in sbx.records]
        assert kinds.count("egress_violation") == 2 and kinds.count("exec_violation") == 2
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait()
        loader.stdout.close()
        gc_stale_pins(pin_root)
        try:
            os.rmdir(pin_root)
        except OSError:
            pass


def test_remove_sandbox_detaches_and_releases(enforce_sensor, enforce_cgroups, enforce_net):
    h, net = enforce_sensor, enforce_net
    sbx = h.sandbox(enforce_cgroups, policy(egress={"default": "deny"}, exec={"allow": ["/usr/bin/python3*"]},
                                            syscalls={"default": "allow", "deny": ["ptrace"]}))
    assert net_actions(sbx.cg, net, [("tcp", net.server_addr, 80)]) == ["EPERM"]
    s = h.sensor
    idx = s._sbx[sbx.cg.id].idx
    assert [k for k in s._exec.keys() if k.idx == idx]
    sbx.remove()
    fd = os.open(sbx.cg.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert all(bpfsys.prog_query(fd, atype) == [] for _, atype in EGRESS_PROGS)
    finally:
        os.close(fd)
    assert net_actions(sbx.cg, net, [("tcp", net.server_addr, 80)]) == ["ok"]
    for m in (s._e4, s._e6, s._exec):
        assert all(k.idx != idx for k in m.keys())
    for m in (s._viol, s._dest, s._counts, s._state, s._cfg):
        assert all(getattr(k, "cgroup_id", getattr(k, "value", None)) != sbx.cg.id for k in m.keys())
    assert all(v.value != sbx.cg.id for v in s._exempt.values())
    with pytest.raises(DsecError, match="not enforced"):
        s.exempt(sbx.cg.id, os.getpid())


def test_remove_sandbox_finds_its_entries_without_walking_the_tables(enforce_sensor, enforce_cgroups, enforce_net):
    """A sandbox whose cgroup is empty at removal (every close) has its exempt pids, violation counters
    and learned destinations removed without a walk of the whole tables (enforce._forget): none of its
    entries is left, and another sandbox's are kept. One whose cgroup still has a process is walked."""
    from agent.sandbox.cgroups import cgroup_populated as _populated
    h, net, s = enforce_sensor, enforce_net, enforce_sensor.sensor

    def entries(cgid):
        return {"viol": [k for k in s._viol.keys() if k.cgroup_id == cgid],
                "dest": [k for k in s._dest.keys() if k.cgroup_id == cgid],
                "exempt": [k.value for k, v in s._exempt.items() if v.value == cgid]}

    # learn mode: two learned destinations; audit mode: violation counters
    learn = policy("learn", egress={"default": "deny"}, syscalls={"default": "allow", "deny": ["ptrace"]})
    sbx_l = h.sandbox(enforce_cgroups, learn)
    work = run_workload(sbx_l.cg, [PYTHON, "-I", "-c", LEARN_WORKLOAD, "1", net.server_addr], netns=net.client,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    work.stdin.write(b"\n")
    work.stdin.close()
    assert work.stdout.readline() == b"done\n" and work.wait(30) == 0
    audit = policy("audit", syscalls={"default": "allow", "deny": ["ptrace", "mount"]})
    sbx_a = h.sandbox(enforce_cgroups, audit)
    p = run_workload(sbx_a.cg, [sys.executable, "-I", "-c", SYSCALL_WORKLOAD, json.dumps(audit.to_dict()), ROOT],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.wait(60) == 0
    # an exempt pid that is not in the cgroup (so the cgroup is empty): this test process
    s.exempt(sbx_a.cg.id, os.getpid())
    # a bystander with a live exempt process, and a sandbox removed while a process still runs in it
    other = h.sandbox(enforce_cgroups, audit)
    sleeper = run_workload(other.cg, ["/bin/sleep", "60"])
    s.exempt(other.cg.id, sleeper.pid)
    busy = h.sandbox(enforce_cgroups, audit)
    busy_p = run_workload(busy.cg, ["/bin/sleep", "60"])
    s.exempt(busy.cg.id, busy_p.pid)
    try:
        h.settle()
        assert len(entries(sbx_l.cg.id)["dest"]) == 2
        assert len(entries(sbx_a.cg.id)["viol"]) == 2 and entries(sbx_a.cg.id)["exempt"] == [os.getpid()]
        assert not _populated(sbx_l.cg.path) and not _populated(sbx_a.cg.path) and _populated(busy.cg.path)
        totals_a = sbx_a.remove()
        assert totals_a["violations"] == {"ptrace": 1000, "mount": 1}
        assert len(sbx_l.remove()["destinations"]) == 2
        busy.remove()
        for sb in (sbx_l, sbx_a, busy):
            assert entries(sb.cg.id) == {"viol": [], "dest": [], "exempt": []}
        assert entries(other.cg.id)["exempt"] == [sleeper.pid]
    finally:
        for proc in (sleeper, busy_p):
            proc.kill()
            proc.wait()
    other.remove()
    assert entries(other.cg.id) == {"viol": [], "dest": [], "exempt": []}


def test_sensor_can_be_closed_and_recreated():
    s = EnforcementSensor(pin_root=TEST_PIN_ROOT)
    pin = s.pin_dir
    assert os.path.exists(os.path.join(pin, "exec"))
    s.close()
    assert not os.path.exists(pin)
    with pytest.raises(DsecError, match="closed"):
        s.poll(1)


def test_a_sensor_failing_after_its_load_leaves_no_pin(monkeypatch):
    """Anything that fails past the programs' load and pinning (here the first
    write of sys_common) unpins and unloads: before, only a failure of the load
    itself did, and the sensor's pin directory stayed behind."""
    def listing():
        return set(os.listdir(TEST_PIN_ROOT)) if os.path.isdir(TEST_PIN_ROOT) else set()
    before = listing()

    def fail(self, without=None):
        raise RuntimeError("sys_common cannot be written")
    monkeypatch.setattr(EnforcementSensor, "_sys_common_set", fail)
    with pytest.raises(RuntimeError, match="sys_common"):
        EnforcementSensor(pin_root=TEST_PIN_ROOT)
    assert listing() == before


# ---------------------------------------------------------------- into ClickHouse

def test_schema_migration_2_adds_the_enforcement_columns(clickhouse_url):
    from exporters.clickhouse_server import connect
    from audit_schema import migrations
    from audit_schema.events import BY_NAME
    client, _ = connect(clickhouse_url)
    db = f"dsec_enf_mig_{os.getpid()}"
    try:
        feat = migrations.detect_features(client)
        # a database made by the version-1 code: migration 1 without the two columns
        client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
        client.execute(migrations.version_table_sql(db))
        for st in migrations.MIGRATIONS[0][2](db, feat):
            for sql in migrations.statement_sql(st, feat):
                client.execute(sql, settings=feat.ddl_settings)
        for col in ("syscall", "protocol"):
            client.execute(f"ALTER TABLE {db}.events DROP COLUMN {col}")
        client.execute(f"INSERT INTO {db}.schema_migrations (version, name, applied_ns, server_version, "
                       "fields_hash) VALUES", [(1, "events table and sandboxes view", 0, feat.version, "")])
        r = migrations.migrate(client, db)
        later = list(range(2, migrations.LATEST + 1))
        assert (r.before, r.after, r.applied, r.added_columns) == (1, migrations.LATEST, later, [])   # steps, not the net
        cols = migrations.table_columns(client, db)
        for col in ("syscall", "protocol"):
            assert cols[col] == migrations.column_type(BY_NAME[col], feat)
        assert migrations.migrate(client, db).applied == []
        rows = client.execute(f"SELECT version FROM {db}.schema_migrations FINAL ORDER BY version")
        assert [v for v, in rows] == [1] + later
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
        client.disconnect()


def test_enforcement_records_land_in_clickhouse(enforce_sensor, enforce_cgroups, clickhouse_url, tmp_path):
    from replay.store import AuditStore
    from exporters.clickhouse import ClickHouseExporter
    h = enforce_sensor
    pol = policy(syscalls={"default": "allow", "deny": ["ptrace", "mount"]},
                 exec={"allow": [sys.executable, "/usr/bin/python3*"]})
    sbx = h.sandbox(enforce_cgroups, pol)
    code = SYSCALL_WORKLOAD.replace("print(json.dumps", "import subprocess; subprocess.run(['/usr/bin/touch', "
                                    f"{str(tmp_path / 'm')!r}]); print(json.dumps")
    p = run_workload(sbx.cg, [sys.executable, "-I", "-c", code, json.dumps(pol.to_dict()), ROOT],
                     stdout=subprocess.PIPE)
    assert json.loads(p.communicate(timeout=60)[0]) == [1]
    sbx.remove()
    recs = sbx.records
    exp = ClickHouseExporter(url=clickhouse_url)
    exp.insert(recs)
    exp.close()
    with AuditStore(clickhouse_url) as store:
        got = list(store.events(sbx.sandbox_id, ["syscall_denied", "exec_denied"]))
    assert sorted(g["event_id"] for g in got) == sorted(r["event_id"] for r in recs
                                                        if r["kind"] in ("syscall_denied", "exec_denied"))
    ex = [g for g in got if g["kind"] == "exec_denied"]
    assert [(g["path"], g["signal"], g["decision"], g["mode"]) for g in ex] == [
        ("/usr/bin/touch", 9, "denied", "enforce")]
    sc = {}
    for g in got:
        if g["kind"] == "syscall_denied":
            sc[g["syscall"]] = sc.get(g["syscall"], 0) + g["count"]
            assert g["policy_hash"] == pol.hash and g["decision"] == "denied"
    assert sc == {"ptrace": 1000, "mount": 1}


def test_syscall_programs_run_only_while_a_sandbox_needs_them(enforce_sensor, enforce_cgroups):
    h = enforce_sensor
    s = h.sensor
    before = s.syscall_hooks()
    sbx = h.sandbox(enforce_cgroups, policy("audit", syscalls={"default": "allow", "deny": ["ptrace"]}))
    hooks = s.syscall_hooks()
    assert hooks["enter"] == {"attached": True, "sandboxes": before["enter"]["sandboxes"] + 1}
    sbx.remove()
    assert s.syscall_hooks()["enter"]["sandboxes"] == before["enter"]["sandboxes"]
    if before["enter"]["sandboxes"] == 0:
        saved, s.sys_hook_linger_s = s.sys_hook_linger_s, 0
        try:
            assert h.poll_until(lambda: not s.syscall_hooks()["enter"]["attached"], 3)
        finally:
            s.sys_hook_linger_s = saved


def test_mmap_programs_run_only_while_an_exec_enforcing_sandbox_needs_them(enforce_sensor, enforce_cgroups):
    """The executable-mapping check (syscalls:sys_enter_mmap/sys_exit_mmap) is
    attached with the first sandbox whose exec rules are enforced, not for one
    without exec rules, and detached once none is left (after the linger)."""
    h = enforce_sensor
    s = h.sensor
    before = s.syscall_hooks()["mmap"]
    plain = h.sandbox(enforce_cgroups, policy("enforce"))
    assert s.syscall_hooks()["mmap"] == before
    plain.remove()
    sbx = h.sandbox(enforce_cgroups, policy("enforce", exec={"allow": ["/usr/bin/*"]}))
    assert s.syscall_hooks()["mmap"] == {"attached": True, "sandboxes": before["sandboxes"] + 1}
    sbx.remove()
    if before["sandboxes"] == 0:
        saved, s.sys_hook_linger_s = s.sys_hook_linger_s, 0
        try:
            assert h.poll_until(lambda: not s.syscall_hooks()["mmap"]["attached"], 3)
        finally:
            s.sys_hook_linger_s = saved


SYSCALL_SPRAY = r'''
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
n, distinct = int(sys.argv[1]), sys.argv[2] == "distinct"
for i in range(n):
    libc.syscall(1000 + i)                        # ENOSYS: every number a violation
if distinct:
    for nr in range(387, 424):                    # unassigned on x86_64: ENOSYS
        libc.syscall(nr)
for _ in range(10):
    libc.ptrace(0x4206, -1, 0, 0)                 # PTRACE_SEIZE of no process: harmless
print("done", flush=True)
'''


def test_violation_table_is_bounded_per_sandbox(enforce_sensor, enforce_cgroups):
    """syscall(1000+i) over 70,000 numbers in one sandbox (issue 13 point 2) leaves
    the (sandbox, syscall) table usable by a neighbour: numbers >= 512 are one
    counter, and a sandbox holds at most 64 counters (the rest is counted in its
    own record as table_full), never the table's 262,144 entries."""
    h = enforce_sensor
    spec = {"syscalls": {"default": "allow", "deny": ["ptrace"]}}
    spray = h.sandbox(enforce_cgroups, policy("audit", name="t-spray", **spec))
    p = run_workload(spray.cg, [PYTHON, "-I", "-c", SYSCALL_SPRAY, "70000", "same"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0, e.decode()
    quiet = h.sandbox(enforce_cgroups, policy("audit", name="t-quiet", **spec))
    p = run_workload(quiet.cg, [PYTHON, "-I", "-c", SYSCALL_SPRAY, "0", "same"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    o, e = p.communicate(timeout=60)
    assert p.returncode == 0, e.decode()
    h.settle()
    s_stats = h.sensor.stats(spray.cg.id)
    assert s_stats["violations"] == {"out_of_range": 70000, "ptrace": 10}
    q_totals = quiet.remove()
    assert q_totals["violations"] == {"ptrace": 10} and q_totals["lost_total"] == 0
    recs = quiet.of_kind("syscall_violation")
    assert sum(r["count"] for r in recs) == 10
    s_totals = spray.remove()
    recs = spray.of_kind("syscall_violation")
    assert sum(r["count"] for r in recs if r["syscall"] == "out_of_range") == 70000
    assert len(recs) < 100                                   # rate-limited: not one record per call
    assert "table_full" not in s_totals["lost"]

    # a policy that denies everything, in audit mode: every distinct call a counter
    wide = h.sandbox(enforce_cgroups, policy("audit", name="t-wide", syscalls={"default": "deny", "allow": []}))
    p = run_workload(wide.cg, [PYTHON, "-I", "-c", SYSCALL_SPRAY, "0", "distinct"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    o, e = p.communicate(timeout=60)
    assert p.returncode == 0, e.decode()
    h.settle()
    w_totals = wide.remove()
    assert len(w_totals["violations"]) == 64                 # the sandbox's share of the table
    assert w_totals["sys_overflow"] > 0
    assert w_totals["lost"]["table_full"]["syscall_violation"] == w_totals["sys_overflow"]
    lost = [r for r in wide.of_kind("events_lost") if _extra(r)["reason"] == "table_full"]
    assert sum(r["count"] for r in lost) == w_totals["sys_overflow"]


def test_slow_dns_does_not_hold_up_other_sandboxes(enforce_sensor, enforce_cgroups, enforce_net):
    """Issue 13 point 8: hostname rules were resolved under the sensor's lock, so a
    slow DNS answer stalled every other sandbox's start. Ordering, not timing: a
    sandbox without hostname rules is registered while the other's DNS query is
    still unanswered."""
    import threading
    h, net = enforce_sensor, enforce_net
    dns = DnsServer({"slow.dsec.test": ([net.addr(5)], 60)})
    dns.gate.clear()
    saved = h.sensor.resolver
    h.sensor.resolver = HostResolver(nameservers=[dns.addr], timeout=30, min_ttl=1, hosts_file="/nonexistent",
                                     system_fallback=False)
    resolving = threading.Event()
    real = h.sensor.resolver.resolve

    def resolve(host):
        resolving.set()
        try:
            return real(host)
        finally:
            resolving.clear()
    h.sensor.resolver.resolve = resolve
    slow_done = {}
    try:
        slow_pol = policy(egress={"default": "deny", "allow": [{"host": "slow.dsec.test", "ports": [80]}]})
        cg_slow = enforce_cgroups()

        def add_slow():
            try:
                slow_done["sbx"] = h.sandbox(enforce_cgroups, slow_pol, cg=cg_slow)
            except Exception as e:   # noqa: BLE001 - reported by the assertions
                slow_done["error"] = e
        t = threading.Thread(target=add_slow)
        t.start()
        assert resolving.wait(10)
        deadline = time.monotonic() + 10
        while dns.queries < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dns.queries >= 1
        quick_box = {}
        q = threading.Thread(target=lambda: quick_box.update(sbx=h.sandbox(
            enforce_cgroups, policy(egress={"default": "deny", "allow": [{"cidr": "10.0.0.0/8"}]}))))
        q.start()
        q.join(20)                      # the other's DNS query stays unanswered for 30 s
        quick_first = not q.is_alive() and resolving.is_set() and t.is_alive()
        dns.gate.set()
        t.join(60)
        q.join(60)
        assert "sbx" in quick_box and quick_first, "the quick sandbox waited for the other's DNS"
        quick = quick_box["sbx"]
        assert "error" not in slow_done, slow_done.get("error")
        assert h.sensor.egress_addresses(slow_done["sbx"].cg.id) == {"slow.dsec.test": [net.addr(5)]}
        quick.remove()
    finally:
        dns.gate.set()
        h.sensor.resolver = saved
        dns.close()
