"""Issue 21, the pure parts: what learning leaves out, how it generalises, the
decision `failed`, the aggregation of identical denials, convergence."""
from __future__ import annotations

import errno
import json

from agent.sensors.denials import DenialAggregator
from policies.compile import exec_allowed
from policies.evaluate import decision, mark_refused_anyway
from policies.learn import additions, derive_policy, random_name, render, stable_tail
from policies.load import load_policy_text


def _run(rid, records, calls=("read", "write")):
    return {"run_id": rid, "records": records, "syscall_counts": {c: 1 for c in calls}}


def _w(path, ret=0, kind="open_write", raw=None):
    return {"kind": kind, "path": path, "ret": ret, "path_raw": raw or path}


def _x(path, ret=0, raw=None):
    return {"kind": "exec", "path": path, "ret": ret, "path_raw": raw or path}


def test_failed_writes_and_execs_are_listed_not_learned():
    recs = [_w("/etc/group/file1", -errno.ENOTDIR), _w("/workspace/a/x", -errno.ENOENT),
            _w("/workspace/out.txt"), _x("/usr/local/bin/tar", -errno.ENOENT), _x("/usr/bin/tar")]
    p = derive_policy([_run("r1", recs)], name="t")
    d = p.to_dict()["spec"]
    assert d["files"]["writable"] == ["/workspace"]
    assert d["exec"]["allow"] == ["/usr/bin/tar"]
    text = render(p)
    assert "/etc/group/file1 (ENOTDIR)" in text and "/usr/local/bin/tar (ENOENT)" in text


def test_random_names_cut_to_their_directory_with_the_rule_in_the_comment():
    assert random_name("tmpk2j3h4x1") == "tempfile name" and random_name("python3") is None
    p = derive_policy([_run("r1", [_w("/workspace/build/tmpab12cd34/out.o")])], name="t")
    assert p.to_dict()["spec"]["files"]["writable"] == ["/workspace/build"]
    assert "per-run random names under it (tempfile name tmpab12cd34)" in render(p)


def test_loopback_ephemeral_ports_become_the_range_other_ports_stay_exact():
    recs = [{"kind": "connect", "family": "ipv4", "addr": "127.0.0.1", "port": 41234, "ret": 0},
            {"kind": "connect", "family": "ipv4", "addr": "127.0.0.1", "port": 8080, "ret": 0},
            {"kind": "connect", "family": "ipv4", "addr": "10.1.2.3", "port": 45000, "ret": 0}]
    eg = derive_policy([_run("r1", recs)], name="t").to_dict()["spec"]["egress"]["allow"]
    assert {"cidr": "127.0.0.1/32", "ports": [8080, "32768-60999"], "protocol": "any"} in eg
    assert {"cidr": "10.1.2.3/32", "ports": [45000], "protocol": "any"} in eg


def test_files_the_sandbox_wrote_and_ran_become_allow_written_under():
    r1 = _run("r1", [_w("/tmp/tmpaaaa1111/run.sh"), _x("/tmp/tmpaaaa1111/run.sh"),
                     _w("/workspace/bin/tool"), _x("/workspace/bin/tool"), _x("/workspace/given", raw="./given"),
                     _w("/workspace/log.txt")])
    p = derive_policy([r1], name="t")
    x = p.to_dict()["spec"]["exec"]
    assert x["allow_written_under"] == ["/tmp", "/workspace"]
    assert x["allow"] == ["/workspace/given"]          # not written by the run: stays exact
    text = render(p)
    assert "exec.allow_written_under /tmp: files the sandbox wrote there itself" in text
    assert "run by its relative name ./given" in text
    again = load_policy_text(text, "<t>")
    assert again.to_dict() == p.to_dict()
    enf = p.with_mode("enforce")
    assert exec_allowed(enf, "/tmp/tmpzzzz9999/other.sh")              # another run's random name
    assert not exec_allowed(enf, "/tmp/../usr/bin/curl")               # prefix rules match canonical paths only
    assert exec_allowed(enf, "/workspace/given")
    assert not exec_allowed(enf, "./given")      # no cwd known: matches nothing (issue 21)
    assert exec_allowed(enf, "./given", cwd="/workspace")      # joined to the cwd, as the kernel's check does
    assert not exec_allowed(enf, "../workspace/given", cwd="/workspace")    # not canonical once joined
    assert "under enforce the kernel's check joins it to the cwd the agent verifies" in text
    assert not exec_allowed(enf, "/usr/bin/curl")


def test_a_live_relative_exec_is_learned_only_at_a_verified_cwd():
    """A live record of a relative exec (path_resolution set) is learned only when the
    kernel's record carried the verified cwd ("verified"); one placed from /proc after
    the fact (best_effort) or not at all is listed, never allowed (issue 21)."""
    def x(path, raw, how):
        return dict(_x(path, raw=raw), path_resolution=how)
    p = derive_policy([_run("r1", [x("/usr/bin/true", "./true", "verified"),
                                   x("/usr/bin/sleep", "./sleep", "best_effort"),
                                   x("./id", "./id", "unresolved"), _x("/usr/bin/env")])], name="t")
    assert p.to_dict()["spec"]["exec"]["allow"] == ["/usr/bin/env", "/usr/bin/true"]
    text = render(p)
    assert "run by its relative name ./true (placed at the cwd the agent verified" in text
    head = text.split("\nspec:", 1)[0]
    assert "relative execs whose cwd was not verified" in head
    assert "./sleep (/proc showed /usr/bin/sleep later)" in head and "./id" in head


def test_decision_failed_is_not_a_policy_denial():
    p = derive_policy([_run("r1", [_x("/usr/bin/python3"), _w("/workspace/x")])], name="t")
    enf, aud = p.with_mode("enforce"), p.with_mode("audit")
    missing = {"kind": "exec", "path": "/usr/local/bin/nope", "ret": -errno.ENOENT}
    assert decision(enf, missing) == "failed" and decision(aud, missing) == "failed"
    assert decision(enf, {"kind": "exec", "path": "/usr/bin/id", "ret": 0}) == "denied"
    assert decision(enf, {"kind": "open_write", "path": "/etc/x", "ret": -errno.EROFS}) == "denied"
    # EROFS, but the agent found the sandbox's user had no permission there anyway
    rofs = {"kind": "open_write", "path": "/etc/x", "ret": -errno.EROFS, "extra": json.dumps({"gid": 1000})}
    mark_refused_anyway(rofs, "EACCES: /etc is 0:0 drwxr-xr-x: uid 1000 gid 1000 (other) has no write permission")
    assert decision(enf, rofs) == "failed" and json.loads(rofs["extra"])["refused_anyway"] == "EACCES"
    assert json.loads(rofs["extra"])["gid"] == 1000
    mark_refused_anyway(rofs2 := {"kind": "unlink", "path": "/etc/y", "ret": -errno.EROFS}, None)
    assert decision(enf, rofs2) == "denied"
    assert decision(enf, {"kind": "open_write", "path": "/etc/group/x", "ret": -errno.ENOTDIR}) == "failed"
    # a relative write the kernel let through: the layout allowed it, no denial claimed
    assert decision(enf, {"kind": "unlink", "path": "test0.txt", "ret": 0}) == "allowed"
    assert decision(enf, {"kind": "unlink", "path": "test0.txt", "ret": -errno.EROFS}) == "denied"


def test_identical_denials_aggregated_with_counts_and_first_last():
    ids = iter(range(1000))
    agg = DenialAggregator(lambda: f"id{next(ids)}")
    base = {"sandbox_id": "s", "step": 1, "kind": "exec", "decision": "failed", "path": "/usr/local/bin/x"}
    out = []
    for i in range(5):
        out += agg.offer({**base, "ts_ns": 100 + i, "pid": 10 + i, "event_id": f"e{i}"})
    out += agg.offer({**base, "path": "/other", "ts_ns": 200, "event_id": "o"})
    out += agg.offer({"sandbox_id": "s", "kind": "exec", "decision": "allowed", "path": "/usr/bin/a", "ts_ns": 1})
    out += agg.offer({"sandbox_id": "s", "kind": "exec", "decision": "allowed", "path": "/usr/bin/a", "ts_ns": 2})
    assert [r.get("event_id") for r in out] == ["e0", "o", None, None]     # first of each key; allowed all pass
    summ = agg.flush("s")
    assert len(summ) == 1 and summ[0]["count"] == 4
    ex = json.loads(summ[0]["extra"])
    assert ex["aggregated"] and ex["total"] == 5 and ex["first_ts_ns"] == 100 and ex["last_ts_ns"] == 104
    assert ex["pids"] == [10, 11, 12, 13, 14] and agg.flush("s") == []


def test_denials_that_differ_in_the_name_given_or_why_are_not_one():
    """Two refusals are identical only if the kernel was given the same name and refused
    it for the same reason. A path placed best-effort (the decoder's /proc read, '.'
    components dropped) can make `usr/./bin/true` from / (not canonical) and `./true`
    from /usr/bin (cwd unknown) both /usr/bin/true: merged, the second was left as a
    count under the first's reason (test_relative_exec failed on it under load)."""
    ids = iter(range(1000))
    agg = DenialAggregator(lambda: f"id{next(ids)}")
    base = {"sandbox_id": "s", "step": 1, "kind": "exec_violation", "decision": "would-deny",
            "path": "/usr/bin/true"}
    recs = [{**base, "path_raw": "usr/./bin/true", "extra": json.dumps({"status": ["not_absolute", "not_canonical"]})},
            {**base, "path_raw": "./true", "extra": json.dumps({"status": ["not_absolute", "cwd_unknown"]})},
            {**base, "path_raw": "./true", "extra": json.dumps({"status": ["not_absolute", "cwd_joined"]})},
            {**base, "path_raw": "./true", "extra": json.dumps({"status": ["not_absolute", "cwd_unknown"], "gid": 7})}]
    out = []
    for i, r in enumerate(recs):
        out += agg.offer({**r, "ts_ns": i, "event_id": f"e{i}"})
    assert [r["event_id"] for r in out] == ["e0", "e1", "e2"]      # the last one is e1's repeat
    summ = agg.flush("s")
    assert len(summ) == 1 and summ[0]["path_raw"] == "./true" and json.loads(summ[0]["extra"])["total"] == 2


def test_additions_per_run_and_stability():
    r1 = _run("r1", [_x("/usr/bin/python3")], ("read",))
    r2 = _run("r2", [_x("/usr/bin/python3"), _x("/usr/bin/tar")], ("read", "write"))
    r3 = _run("r3", [_x("/usr/bin/tar")], ("write",))
    adds = additions([r1, r2, r3])
    assert adds[0]["added"]["exec"] == ["/usr/bin/python3"]
    assert adds[1]["added"] == {"syscalls": ["write"], "exec": ["/usr/bin/tar"]}
    assert adds[2]["total"] == 0 and stable_tail(adds) == 1
