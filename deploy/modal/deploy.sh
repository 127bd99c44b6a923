#!/usr/bin/env bash
# Deploy lmserve to Modal (deploy/modal/app.py), then send one chat completion so the deployment is warm.
#   MODEL_NAME=<org>/<repo> deploy/modal/deploy.sh      (default LiquidAI/LFM2-8B-A1B)
# A cold start (image pull, weights download, vLLM start) takes over 2 minutes: the warm-up request is retried
# every WARMUP_INTERVAL seconds (10) for up to WARMUP_TIMEOUT seconds (900).
set -euo pipefail

cd "$(dirname "$0")/../.."
MODEL_NAME=${MODEL_NAME:-LiquidAI/LFM2-8B-A1B}
export MODEL_NAME
WARMUP_TIMEOUT=${WARMUP_TIMEOUT:-900}
WARMUP_INTERVAL=${WARMUP_INTERVAL:-10}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
modal deploy deploy/modal/app.py 2>&1 | tee "$log"
url=$(grep -Eo 'https://[A-Za-z0-9.-]+\.modal\.run' "$log" | tail -n 1 || true)
if [ -z "$url" ]; then
    echo "deploy.sh: no deployment URL in the output of modal deploy" >&2
    exit 1
fi

body=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}' "$MODEL_NAME")
echo "warming up $url (the first start takes over 2 minutes)"
deadline=$((SECONDS + WARMUP_TIMEOUT))
until curl --silent --show-error --fail --max-time 300 "$url/v1/chat/completions" \
        -H 'Content-Type: application/json' -d "$body" >/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "deploy.sh: $url did not answer within ${WARMUP_TIMEOUT} s" >&2
        exit 1
    fi
    sleep "$WARMUP_INTERVAL"
done
echo "lmserve is serving $MODEL_NAME at $url"
