"""OCI / Docker seccomp profiles and Kubernetes SeccompProfile objects, both ways.

    export_oci(policy) -> dict                          # an OCI/Docker seccomp profile
    export_k8s_seccompprofile(policy) -> dict           # security-profiles-operator v1beta1
    export_notes(policy, fmt) -> [str]                  # what the export cannot carry
    import_oci(profile, source) -> (Policy, [note])     # a policy from a profile
    load_oci_file(path) -> dict                         # bounded read + JSON errors with line

Import evaluates the profile as it applies to a dsec sandbox: an x86_64 process
with no capabilities. Per rule: includes.arches must name amd64/x86_64 and
excludes.arches must not; includes.caps rules are dropped (no capabilities),
excludes.caps rules apply; includes.minKernel is taken as satisfied. Rules with
argument conditions are translated exactly when dsec has the concept
(clone/unshare with CLONE_NEW* flags -> namespaces: deny; clone3 ENOSYS);
otherwise the call is allowed when a conditional rule allows it (the default,
`conditional="allow"`) or denied (`conditional="deny"`), with a note naming
the conditions dropped. Every approximation produces a note.

The built-in `default` policy is derived from the containers-common profile
with derive_default() (see policies/README.md, "The built-in policies").
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

from policies import syscalls as sc
from policies.load import _display, decode_utf8, policy_from_data, read_bounded, to_yaml
from policies.model import (API_VERSION, CLONE_NS_FLAGS, KIND, UNSHARE_NS_FLAGS, Policy, PolicyError,
                            canonical, content_hash, errno_number)

import errno as _errno

ARCHITECTURES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
K8S_API_VERSION = "security-profiles-operator.x-k8s.io/v1beta1"
K8S_KIND = "SeccompProfile"
CONTAINERS_PROFILE = "/usr/share/containers/seccomp.json"
ANNOTATION_PREFIX = "dsec.dev/"

ACTIONS = {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD",
           "SCMP_ACT_LOG", "SCMP_ACT_TRAP", "SCMP_ACT_TRACE", "SCMP_ACT_NOTIFY"}
OPS = {"SCMP_CMP_NE": "!=", "SCMP_CMP_LT": "<", "SCMP_CMP_LE": "<=", "SCMP_CMP_EQ": "==", "SCMP_CMP_GE": ">=",
       "SCMP_CMP_GT": ">", "SCMP_CMP_MASKED_EQ": "&"}
_AMD64 = {"amd64", "x86_64", "SCMP_ARCH_X86_64"}

# What Docker's default profile (moby profiles/seccomp/default.json) allows only
# with a capability (CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_BOOT, CAP_SYSLOG) or
# never, but containers-common 0.50 allows outright (it relies on the container
# having no capabilities, which a user namespace undoes). The `default` built-in
# denies them too, with EPERM, as the issue asks (mount, namespaces, keyctl,
# ptrace, bpf, perf_event_open, kexec, modules, io_uring, ...).
EXTRA_DENY = (
    "mount", "umount2", "pivot_root", "mount_setattr", "move_mount", "open_tree", "open_tree_attr",
    "fsopen", "fsconfig", "fsmount", "fspick",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "process_madvise",
    "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "reboot", "syslog", "quotactl", "quotactl_fd", "acct",
    "swapon", "swapoff", "iopl", "ioperm", "settimeofday", "clock_settime", "vhangup",
)


# ---------------------------------------------------------------- export

def _errno_ret(name: str) -> int:
    return errno_number(name)


def _syscall_rules(policy: Policy, mode: str) -> tuple[dict, list[dict]]:
    """(top-level fields, syscalls[]) for the policy in `mode`."""
    s = canonical(policy)["spec"]["syscalls"]
    enforce = mode == "enforce"
    if enforce and s["action"] == "kill":
        deny = {"action": "SCMP_ACT_KILL_PROCESS"}
    elif enforce:
        deny = {"action": "SCMP_ACT_ERRNO", "errnoRet": _errno_ret(s["errno"])}
    else:
        deny = {"action": "SCMP_ACT_LOG"}
    errnos = s.get("errnos", {}) if enforce else {}
    ns_deny = s["namespaces"] == "deny"
    enosys = {"action": "SCMP_ACT_ERRNO", "errnoRet": _errno.ENOSYS}
    rules: list[dict] = []

    def rule(names, action: dict, args=None):
        r = {"names": sorted(names), **action}
        if args:
            r["args"] = args
        rules.append(r)

    def mask_arg(mask, value):
        return [{"index": 0, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]

    def errno_groups(names):
        by = defaultdict(list)
        for n in names:
            by[errnos[n]].append(n)
        for e, ns in sorted(by.items()):
            rule(ns, {"action": "SCMP_ACT_ERRNO", "errnoRet": _errno_ret(e)})

    if s["default"] == "deny":
        top = {"defaultAction": deny["action"]}
        if "errnoRet" in deny:
            top["defaultErrnoRet"] = deny["errnoRet"]
        allow = set(s["allow"])
        plain = {n for n in allow if not (ns_deny and n in ("clone", "unshare", "clone3", "setns"))}
        if plain:
            rule(plain, {"action": "SCMP_ACT_ALLOW"})
        if ns_deny and "clone" in allow:
            rule(["clone"], {"action": "SCMP_ACT_ALLOW"}, mask_arg(CLONE_NS_FLAGS, 0))
        if ns_deny and "unshare" in allow:
            rule(["unshare"], {"action": "SCMP_ACT_ALLOW"}, mask_arg(UNSHARE_NS_FLAGS, 0))
        errno_groups([n for n in errnos if n != "clone3"])
        if "clone3" in errnos:
            rule(["clone3"], {"action": "SCMP_ACT_ERRNO", "errnoRet": _errno_ret(errnos["clone3"])})
        elif ns_deny or "clone3" not in allow:
            rule(["clone3"], enosys)
    else:
        top = {"defaultAction": "SCMP_ACT_ALLOW"}
        denied = set(s["deny"])
        plain = [n for n in denied if n not in errnos and n != "clone3"]
        if plain:
            rule(plain, deny)
        errno_groups([n for n in errnos if n != "clone3"])
        if ns_deny:
            if "clone" not in denied:
                for bit in (1 << i for i in range(32) if CLONE_NS_FLAGS & (1 << i)):
                    rule(["clone"], deny, mask_arg(bit, bit))
            if "unshare" not in denied:
                for bit in (1 << i for i in range(32) if UNSHARE_NS_FLAGS & (1 << i)):
                    rule(["unshare"], deny, mask_arg(bit, bit))
            if "setns" not in denied:
                rule(["setns"], deny)
        if "clone3" in errnos:
            rule(["clone3"], {"action": "SCMP_ACT_ERRNO", "errnoRet": _errno_ret(errnos["clone3"])})
        elif ns_deny or "clone3" in denied:
            rule(["clone3"], enosys)
    return top, rules


def export_oci(policy: Policy, mode: str | None = None) -> dict:
    """The syscall part of the policy as an OCI/Docker seccomp profile. In enforce
    mode denied calls get SCMP_ACT_ERRNO (errnoRet) or SCMP_ACT_KILL_PROCESS; in
    audit and learn mode SCMP_ACT_LOG (reported, not blocked)."""
    mode = mode or policy.spec.mode
    top, rules = _syscall_rules(policy, mode)
    return {**top, "architectures": list(ARCHITECTURES), "syscalls": rules}


def export_k8s_seccompprofile(policy: Policy, mode: str | None = None, name: str | None = None,
                              namespace: str | None = None) -> dict:
    """A security-profiles-operator SeccompProfile (v1beta1). Its spec has no
    defaultErrnoRet: a default-deny policy's denied calls get EPERM there."""
    mode = mode or policy.spec.mode
    top, rules = _syscall_rules(policy, mode)
    top.pop("defaultErrnoRet", None)
    md: dict = {"name": name or policy.name,
                "annotations": {ANNOTATION_PREFIX + "policy-name": policy.name,
                                ANNOTATION_PREFIX + "policy-hash": content_hash(policy),
                                ANNOTATION_PREFIX + "mode": mode}}
    if namespace:
        md["namespace"] = namespace
    return {"apiVersion": K8S_API_VERSION, "kind": K8S_KIND, "metadata": md,
            "spec": {**top, "architectures": list(ARCHITECTURES), "syscalls": rules}}


def export_notes(policy: Policy, fmt: str = "oci-seccomp", mode: str | None = None) -> list[str]:
    """What the exported profile does not carry (for the CLI to print)."""
    mode = mode or policy.spec.mode
    s = canonical(policy)["spec"]
    notes = []
    if mode != "enforce":
        notes.append(f"mode {mode}: denied calls are exported as SCMP_ACT_LOG (allowed and logged)")
        if mode == "learn":
            notes.append("learn mode is a dsec concept: importing this profile gives an audit policy")
    for part in ("egress", "exec", "files"):
        if part in s:
            notes.append(f"spec.{part} is not part of a seccomp profile and is not exported")
    sy = s["syscalls"]
    if (fmt == "k8s-seccompprofile" and mode == "enforce" and sy["default"] == "deny"
            and sy["action"] == "errno" and sy["errno"] != "EPERM"):
        notes.append(f"SeccompProfile has no defaultErrnoRet: calls denied by default get EPERM, not {sy['errno']}")
    notes.append("x86 and x32 are listed as architectures (names map per ABI); dsec itself kills calls "
                 "from those ABIs in enforce mode")
    return notes


# ---------------------------------------------------------------- import

def load_oci_file(path: str) -> dict:
    """A profile file as data (bounded, UTF-8, JSON; errors name the line)."""
    source = _display(path)
    text = decode_utf8(read_bounded(path, source), source)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{source}:{e.lineno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise PolicyError(f"{source}: invalid JSON: nested too deeply") from None
    return data


class _Rule:
    __slots__ = ("idx", "action", "errno", "args")

    def __init__(self, idx, action, errno, args):
        self.idx, self.action, self.errno, self.args = idx, action, errno, args


def _cond_text(args: list[dict]) -> str:
    parts = []
    for a in args:
        op = a.get("op")
        if op == "SCMP_CMP_MASKED_EQ":
            parts.append(f"arg{a.get('index')} & {a.get('value', 0):#x} == {a.get('valueTwo', 0):#x}")
        else:
            parts.append(f"arg{a.get('index')} {OPS.get(op, op)} {a.get('value', 0)}")
    return " && ".join(parts)


def _check_profile(profile, source: str) -> list[dict]:
    def bad(where, msg):
        raise PolicyError(f"{source}: {where}: {msg}")
    if not isinstance(profile, dict):
        raise PolicyError(f"{source}: expected a JSON object (a seccomp profile), got {type(profile).__name__}")
    if "defaultAction" not in profile:
        raise PolicyError(f"{source}: not a seccomp profile: no defaultAction")
    if profile["defaultAction"] not in ACTIONS:
        bad("defaultAction", f"unknown action {profile['defaultAction']!r}")
    for k in ("defaultErrnoRet",):
        if k in profile and profile[k] is not None and (not isinstance(profile[k], int) or isinstance(profile[k], bool)
                                                        or not 0 <= profile[k] <= 4095):
            bad(k, "expected an errno number")
    rules = profile.get("syscalls") or []
    if not isinstance(rules, list):
        bad("syscalls", "expected a list")
    for i, r in enumerate(rules):
        w = f"syscalls[{i}]"
        if not isinstance(r, dict):
            bad(w, "expected an object")
        names = r.get("names", [r["name"]] if "name" in r else None)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            bad(w + ".names", "expected a list of syscall names")
        if r.get("action") not in ACTIONS:
            bad(w + ".action", f"unknown action {r.get('action')!r}")
        er = r.get("errnoRet")
        if er is not None and (not isinstance(er, int) or isinstance(er, bool) or not 0 <= er <= 4095):
            bad(w + ".errnoRet", "expected an errno number")
        args = r.get("args") or []
        if not isinstance(args, list):
            bad(w + ".args", "expected a list")
        for j, a in enumerate(args):
            if not isinstance(a, dict) or a.get("op") not in OPS:
                bad(f"{w}.args[{j}]", f"expected {{index, value, valueTwo, op}} with op one of {', '.join(OPS)}")
            idx = a.get("index")
            if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx <= 5:
                bad(f"{w}.args[{j}].index", "expected 0..5")
            for k in ("value", "valueTwo"):
                v = a.get(k, 0)
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
                    bad(f"{w}.args[{j}].{k}", "expected an unsigned 64-bit number")
        for part in ("includes", "excludes"):
            if r.get(part) is not None and not isinstance(r.get(part), dict):
                bad(f"{w}.{part}", "expected an object")
    return rules


def _is_ns_rule(name: str, r: _Rule) -> bool:
    """clone/unshare rules that express 'no namespace creation' (Docker's or dsec's form)."""
    if name not in ("clone", "unshare") or len(r.args) != 1:
        return False
    a = r.args[0]
    if a.get("index") != 0 or a.get("op") != "SCMP_CMP_MASKED_EQ":
        return False
    mask, val = a.get("value", 0), a.get("valueTwo", 0)
    full = CLONE_NS_FLAGS if name == "clone" else UNSHARE_NS_FLAGS
    if r.action == "allow" and val == 0 and mask & CLONE_NS_FLAGS == CLONE_NS_FLAGS and not mask & ~full:
        return True
    return r.action in ("errno", "kill") and mask == val and bin(mask).count("1") == 1 and mask & full


def import_oci(profile: dict, source: str = "<profile>", *, name: str | None = None,
               conditional: str = "allow") -> tuple[Policy, list[str]]:
    """A dsec policy from an OCI/Docker seccomp profile (or a SeccompProfile object),
    and notes on every rule dsec cannot express exactly."""
    if conditional not in ("allow", "deny"):
        raise PolicyError(f"conditional must be allow or deny, not {conditional!r}")
    if isinstance(profile, dict) and profile.get("kind") == K8S_KIND and isinstance(profile.get("spec"), dict):
        name = name or (profile.get("metadata") or {}).get("name")
        profile = profile["spec"]
    rules = _check_profile(profile, source)
    notes: list[str] = []
    default_action = profile["defaultAction"]
    default_errno = profile.get("defaultErrnoRet")
    if default_errno is None:
        default_errno = _errno.EPERM
    arches = set(profile.get("architectures") or [])
    for am in profile.get("archMap") or []:
        if isinstance(am, dict):
            arches.add(am.get("architecture"))
            arches.update(am.get("subArchitectures") or [])
    if arches and "SCMP_ARCH_X86_64" not in arches and "SCMP_ARCH_NATIVE" not in arches:
        notes.append("the profile does not list SCMP_ARCH_X86_64; its rules were imported for x86_64 anyway")
    for k in ("flags", "listenerPath", "listenerMetadata"):
        if profile.get(k):
            notes.append(f"{k} is ignored (dsec has no equivalent)")

    def act(a, errno_ret):
        if a == "SCMP_ACT_ALLOW":
            return "allow", None
        if a == "SCMP_ACT_ERRNO":
            return "errno", _errno.EPERM if errno_ret is None else errno_ret
        if a in ("SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD"):
            return "kill", None
        if a == "SCMP_ACT_LOG":
            return "log", None
        return "other:" + a, None

    per_name: dict[str, list[_Rule]] = defaultdict(list)
    unknown: set[str] = set()
    skipped_arch = 0
    skipped_caps: dict[str, set] = defaultdict(set)
    min_kernel: dict[str, set] = defaultdict(set)
    for i, r in enumerate(rules):
        inc, exc = r.get("includes") or {}, r.get("excludes") or {}
        names = r.get("names", [r["name"]] if "name" in r else [])
        if inc.get("arches") and not _AMD64 & set(inc["arches"]):
            skipped_arch += 1
            continue
        if exc.get("arches") and _AMD64 & set(exc["arches"]):
            skipped_arch += 1
            continue
        if inc.get("caps"):
            for n in names:
                skipped_caps[",".join(inc["caps"])].add(n)
            continue
        if exc.get("minKernel"):
            notes.append(f"syscalls[{i}] ({', '.join(names)}) applies only below kernel {exc['minKernel']}: skipped")
            continue
        if inc.get("minKernel"):
            min_kernel[str(inc["minKernel"])].update(names)
        action, eno = act(r["action"], r.get("errnoRet"))
        if action.startswith("other:"):
            notes.append(f"syscalls[{i}] ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}): "
                         f"{action[6:]} is not supported by dsec: the calls are denied instead")
            action, eno = "errno", _errno.EPERM
        for n in names:
            if not sc.is_syscall(n):
                unknown.add(n)
                continue
            per_name[n].append(_Rule(i, action, eno, r.get("args") or []))
    if skipped_arch:
        notes.append(f"{skipped_arch} rules for other architectures do not apply to x86_64 and were skipped")
    for caps, names in sorted(skipped_caps.items()):
        notes.append(f"rules that need {caps} (a dsec sandbox has no capabilities) were skipped: "
                     f"{', '.join(sorted(names))}")
    for k, names in sorted(min_kernel.items()):
        notes.append(f"rules for kernels >= {k} were applied (assumed satisfied): {', '.join(sorted(names))}")
    if unknown:
        u = sorted(unknown)
        notes.append(f"{len(u)} names are not x86_64 system calls and were skipped: "
                     f"{', '.join(u[:12])}{', ...' if len(u) > 12 else ''}")

    # the profile's default, as (kind, errno)
    d_kind, d_errno = act(default_action, default_errno)
    if d_kind.startswith("other:"):
        notes.append(f"defaultAction {d_kind[6:]} is not supported by dsec: calls are denied with EPERM instead")
        d_kind, d_errno = "errno", _errno.EPERM
    mode = "audit" if d_kind == "log" else "enforce"
    default = "allow" if d_kind in ("allow",) else "deny"

    # decide each call
    decision: dict[str, tuple[str, int | None]] = {}
    ns_deny = False
    cond_notes = []
    for n, rs in per_name.items():
        uncond = [r for r in rs if not r.args]
        cond = [r for r in rs if r.args]
        if n in ("clone", "unshare") and cond and all(_is_ns_rule(n, r) for r in cond):
            # "no CLONE_NEW* flags": Docker's allow-if-none form or dsec's deny-per-flag form
            if n == "clone":
                ns_deny = True
            if uncond:
                decision[n] = (uncond[0].action, uncond[0].errno)
            elif any(r.action == "allow" for r in cond) or default == "allow":
                decision[n] = ("allow", None)
            else:
                decision[n] = (d_kind, d_errno)
            continue
        if uncond:
            kinds = {(r.action, r.errno) for r in uncond}
            if len(kinds) > 1:
                notes.append(f"{n}: conflicting rules (syscalls[{', '.join(str(r.idx) for r in uncond)}]); "
                             f"the first one (syscalls[{uncond[0].idx}]) is used")
            decision[n] = (uncond[0].action, uncond[0].errno)
            if cond:
                cond_notes.append(f"{n}: conditional rules ({'; '.join(_cond_text(r.args) for r in cond)}) "
                                  "are overridden by an unconditional rule")
            continue
        conds = "; ".join(f"{r.action}{'(' + str(r.errno) + ')' if r.errno else ''} when {_cond_text(r.args)}"
                          for r in cond)
        allows = [r for r in cond if r.action in ("allow", "log")]
        if conditional == "allow" and allows:
            decision[n] = ("allow", None)
            cond_notes.append(f"{n}: the profile decides by argument ({conds}); dsec allows it outright")
        elif conditional == "deny" and allows:
            decision[n] = (d_kind, d_errno) if default == "deny" else ("errno", _errno.EPERM)
            cond_notes.append(f"{n}: the profile decides by argument ({conds}); dsec denies it outright")
        else:
            denies = [r for r in cond if r.action not in ("allow", "log")]
            if default == "allow":
                decision[n] = (denies[0].action, denies[0].errno)
                cond_notes.append(f"{n}: the profile denies it only when {_cond_text(denies[0].args)}; "
                                  "dsec denies it outright")
            else:
                cond_notes.append(f"{n}: the profile denies it only when {_cond_text(denies[0].args)}; "
                                  "it is denied anyway by default")
    notes += cond_notes

    logged = sorted(n for n, (k, _) in decision.items() if k == "log")
    if ("unshare" in per_name and not ns_deny and any(_is_ns_rule("unshare", r) for r in per_name["unshare"])):
        notes.append("unshare: the profile restricts its namespace flags but not clone's: "
                     "dsec cannot restrict one without the other (namespaces: allow)")

    syscalls: dict = {"default": default}
    if default == "deny":
        allow = sorted(n for n, (k, _) in decision.items() if k in ("allow", "log"))
        if ns_deny:
            allow = [n for n in allow if n not in ("setns", "clone3")]
        syscalls["allow"] = allow
        if d_kind == "kill":
            syscalls["action"] = "kill"
            errnos = {n: e for n, (k, e) in decision.items() if k == "errno"}
        else:
            syscalls["action"] = "errno"
            if mode == "enforce":
                syscalls["errno"] = _errno.errorcode.get(d_errno, d_errno)
            errnos = {n: e for n, (k, e) in decision.items() if k == "errno" and e != d_errno}
            killed = sorted(n for n, (k, _) in decision.items() if k == "kill")
            if killed:
                notes.append(f"calls the profile kills are denied with the default errno instead "
                             f"(one action per policy): {', '.join(killed)}")
    else:
        denied = {n: (k, e) for n, (k, e) in decision.items() if k not in ("allow", "log")}
        syscalls["deny"] = sorted(denied)         # (setns and clone3 are implied by namespaces: deny)
        kills = [n for n, (k, _) in denied.items() if k == "kill"]
        errs = {n: e for n, (k, e) in denied.items() if k == "errno"}
        if kills:
            syscalls["action"] = "kill"
            errnos = errs
        else:
            syscalls["action"] = "errno"
            common = Counter(errs.values()).most_common(1)
            main = common[0][0] if common else _errno.EPERM
            syscalls["errno"] = _errno.errorcode.get(main, main)
            errnos = {n: e for n, e in errs.items() if e != main}
        if logged and all(k == "log" for k, _ in decision.values() if k != "allow"):
            mode = "audit"                 # a profile that only logs some calls: those are the would-deny set
            syscalls["deny"] = logged
            syscalls.pop("errno", None)
            logged = []
    if logged:
        notes.append(f"calls the profile only logs are allowed (dsec reports violations itself): {', '.join(logged)}")
    # clone3 ENOSYS is what dsec does anyway when it is denied or namespaces are denied
    if errnos.get("clone3") == _errno.ENOSYS:
        errnos.pop("clone3")
    if ns_deny and "setns" in decision and decision["setns"][0] in ("allow", "log"):
        notes.append("setns: allowed by the profile, but dsec's namespaces: deny also denies joining namespaces")
    bad_errno = sorted(n for n, e in errnos.items() if e not in _errno.errorcode or e == 0)
    if bad_errno:
        notes.append(f"errno values dsec cannot name were replaced by EPERM for: {', '.join(bad_errno)}")
        for n in bad_errno:
            errnos.pop(n)
    if errnos:
        syscalls["errnos"] = {n: _errno.errorcode[e] for n, e in sorted(errnos.items())}
    syscalls["namespaces"] = "deny" if ns_deny else "allow"
    if not ns_deny:
        notes.append("the profile does not restrict clone/unshare namespace flags: namespaces: allow")
    pname = name or _policy_name(source)
    data = {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": pname,
                         "annotations": {ANNOTATION_PREFIX + "imported-from": os.path.basename(source)[:200]
                                         or "profile"}},
            "spec": {"mode": mode, "syscalls": syscalls}}
    policy = policy_from_data(data, source)
    return policy, notes


def _policy_name(source: str) -> str:
    import re
    base = os.path.basename(source or "").rsplit(".", 1)[0].lower()
    base = re.sub(r"[^a-z0-9._-]+", "-", base).strip("-._")[:63].strip("-._")
    return base or "imported"


# ---------------------------------------------------------------- the `default` built-in

def derive_default(profile: dict) -> tuple[dict, list[str]]:
    """The `default` built-in's syscalls section from the containers-common profile:
    deny what the profile denies an x86_64 process without capabilities (with
    ENOSYS where the profile denies by its default action, so libc falls back
    from calls newer than the profile, and EPERM where it lists the call), plus
    EXTRA_DENY with EPERM; namespaces: deny. Returns (syscalls section, notes)."""
    imported, notes = import_oci(profile, CONTAINERS_PROFILE)
    s = canonical(imported)["spec"]["syscalls"]
    if s["default"] != "deny":
        raise PolicyError("the containers-common profile was expected to be an allowlist (default deny)")
    allowed = set(s["allow"])
    profile_errno = s.get("errno", "EPERM")
    per_call = s.get("errnos", {})
    errnos: dict[str, str] = {}
    deny = set()
    for n in sc.names():
        if n not in allowed:
            deny.add(n)
            e = per_call.get(n, profile_errno)
            if e != "EPERM":
                errnos[n] = e
    for n in EXTRA_DENY:
        if sc.is_syscall(n):
            deny.add(n)
            errnos.pop(n, None)
    # clone3 (ENOSYS) and setns are handled by namespaces: deny
    deny -= {"clone3", "setns"}
    errnos.pop("clone3", None)
    errnos.pop("setns", None)
    out = {"default": "allow", "action": "errno", "errno": "EPERM", "namespaces": "deny",
           "deny": sorted(deny)}
    if errnos:
        out["errnos"] = dict(sorted(errnos.items()))
    return out, notes


_DEFAULT_DOC = {
    "default": "Secure default: denies what container runtimes deny an unprivileged container "
               "(containers-common's default seccomp profile, plus Docker's capability-gated calls), "
               "namespace creation included; allows the rest. Egress per dsec run --network.",
    "default-audit": "The default policy in audit mode: reports what default would deny, blocks nothing.",
    "no-network": "The default policy with all egress denied.",
}


def write_builtins(profile_path: str = CONTAINERS_PROFILE, outdir: str | None = None) -> list[str]:
    """Regenerate policies/builtin/{default,default-audit,no-network}.yaml from the
    containers-common profile (run once, review the diff, commit):
        .venv/bin/python -c 'import policies.oci as o; o.write_builtins()'"""
    outdir = outdir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")
    syscalls, _ = derive_default(load_oci_file(profile_path))
    written = []
    for name, mode, egress in (("default", "enforce", None), ("default-audit", "audit", None),
                               ("no-network", "enforce", {"default": "deny"})):
        spec: dict = {"mode": mode, "syscalls": syscalls}
        if egress:
            spec["egress"] = egress
        doc = {"apiVersion": API_VERSION, "kind": KIND,
               "metadata": {"name": name, "annotations": {"description": _DEFAULT_DOC[name]}},
               "spec": spec}
        text = to_yaml(doc, [f"Built-in policy '{name}'. GENERATED by policies.oci.write_builtins() from",
                             f"{profile_path} (golang-github-containers-common) + policies.oci.EXTRA_DENY;",
                             "do not edit by hand (tests/test_policy.py checks it is current)."])
        path = os.path.join(outdir, name + ".yaml")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        written.append(path)
    return written
