"""Prints which addresses this rank listens on (its own sockets, from /proc), once the process
group and RPC are up; run by test_multinode.py."""
import os
import socket

import hflow
from hflow.runtime.dispatch import dispatch


def listening_addresses(pid: int) -> list[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:   # 0A: LISTEN
                host_hex = fields[1].split(":")[0]
                packed = bytes.fromhex(host_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))
                found.append(socket.inet_ntop(family, packed))
    return found


class Probe:
    def __init__(self, mesh):
        pass

    @dispatch("all")
    def addresses(self):
        return (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("TP_SOCKET_IFNAME"),
                listening_addresses(os.getpid()))


def main(cluster, cfg):
    for rank, (gloo, tp, addresses) in enumerate(cluster.spawn(Probe).addresses()):
        print(f"RANK {rank} GLOO {gloo} TP {tp} LISTENS {' '.join(sorted(set(addresses)))}", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
