-- POSTs one OpenAI-style request body, back to back, on every connection; used by bench/overhead.py.
-- WRK_BODY: the JSON body; WRK_KEY: the bearer key (optional).
-- done() prints one line "WRK_JSON {...}" with counts and latency percentiles in microseconds.
wrk.method = "POST"
wrk.body = os.getenv("WRK_BODY")
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("WRK_KEY")
if key and key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "non2xx": %d, "connect_errors": %d, ' ..
    '"read_errors": %d, "write_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"max_us": %d, "mean_us": %.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
