#!/usr/bin/env bash
# Debian packages the test suite needs: a real Redis server for the storage tier,
# Prometheus (promtool and the server) for the metrics tests, and docker-compose to validate
# compose.yaml against the Compose schema offline. Installs only what is missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)  # joins the test Redis Cluster
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing Debian packages: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The packages start their services where an init system runs; the tests start their own.
for svc in redis-server prometheus; do
  $sudo service "$svc" stop >/dev/null 2>&1 || true
done
