"""The Pod Security Standards' ``restricted`` profile (Kubernetes 1.30), as the admission controller checks a
pod: every rule of ``baseline`` and ``restricted``, for every container, init container and ephemeral
container. :func:`violations` returns one line per broken rule (empty: the pod is admitted).
Written from the policy's published table (policies "Restricted" and "Baseline" of the Pod Security Standards)."""

from __future__ import annotations

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def containers(pod: dict) -> list[tuple[str, dict]]:
    return [(f"{kind}/{c['name']}", c) for kind in ("initContainers", "containers", "ephemeralContainers")
            for c in pod.get(kind, []) or []]


def violations(pod: dict) -> list[str]:
    """Rules of PSS ``restricted`` that the pod spec ``pod`` breaks."""
    out = []
    psc = pod.get("securityContext", {}) or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} must not be true")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod: hostProcess")
    for v in pod.get("volumes", []) or []:
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {v['name']}: hostPath")
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: type {sorted(kinds)} not allowed")
    for s in psc.get("sysctls", []) or []:
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {s['name']} not allowed")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for where, sc_holder in [("pod", psc)]:
        se = sc_holder.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions")
    for name, c in containers(pod):
        sc = c.get("securityContext", {}) or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{name}: seLinuxOptions")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{name}: appArmor Unconfined")
        for p in c.get("ports", []) or []:
            if p.get("hostPort"):
                out.append(f"{name}: hostPort {p['hostPort']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities must drop ALL")
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities add {sorted(added - {'NET_BIND_SERVICE'})}")
        if added - BASELINE_CAPS:
            out.append(f"{name}: capabilities beyond baseline")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container), got {seccomp}")
    return out


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Kind/name -> pod spec of every workload among rendered manifests."""
    out = {}
    for d in docs:
        spec = d.get("spec", {}) or {}
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
            out[f"{d['kind']}/{d['metadata']['name']}"] = spec["template"]["spec"]
        elif d["kind"] == "Pod":
            out[f"Pod/{d['metadata']['name']}"] = spec
        elif d["kind"] == "CronJob":
            out[f"CronJob/{d['metadata']['name']}"] = spec["jobTemplate"]["spec"]["template"]["spec"]
    return out
