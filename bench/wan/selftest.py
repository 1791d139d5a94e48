"""Does the emulated link have the delay and rate asked? (harness/wan.py, harness/wan_check.py)

    python -m bench.wan.selftest [--links 10:50 100:200 1000:10] [--tolerance 0.10]

Each link is RATE_MBIT:RTT_MS. Round trip: small UDP probes echoed from the
far namespace (median of 20; a ping without needing ping). Rate: one TCP
stream for a few seconds, counting the bytes received after the first second
(past slow start). Exits 1 when either is off by more than the tolerance (for
the round trip: or by more than 1 ms, the forwarder's own scheduling cost).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from harness.wan_check import check  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--links", nargs="*", default=["10:50", "100:200", "1000:10"],
                    help="RATE_MBIT:RTT_MS pairs")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    all_ok = True
    for spec in args.links:
        rate, rtt = (float(x) for x in spec.split(":"))
        ok, report = check(rate, rtt, args.tolerance, args.seconds)
        all_ok &= ok
        if args.json:
            print(json.dumps(report))
        else:
            m = report["measured"]
            print(f"asked {rate:g} Mbit/s RTT {rtt:g} ms -> measured "
                  f"{m['rate_mbit']:.1f} Mbit/s ({report.get('rate_error', 0):+.1%}), RTT "
                  f"{m['rtt_ms']:.1f} ms ({report.get('rtt_error', 0):+.1%})  "
                  f"{'OK' if ok else 'OFF BY MORE THAN THE TOLERANCE'}", flush=True)
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
