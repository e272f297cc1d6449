//! HTTP(S) for remote packs: one pooled `ureq` agent per server process (connections are
//! reused), redirects followed (ureq keeps every header but `Authorization` across a
//! redirect, so `Range` survives a registry's redirect to its blob storage), and a retry
//! loop with backoff that gives up at a deadline.

use crate::stats::Counters;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why one attempt failed. Transient failures are retried until the deadline.
#[derive(Debug)]
pub enum Failure {
    Transient(String),
    Permanent(String),
}

impl Failure {
    fn message(&self) -> &str {
        match self {
            Failure::Transient(m) | Failure::Permanent(m) => m,
        }
    }
}

pub struct Http {
    agent: ureq::Agent,
    pub counters: Arc<Counters>,
    /// Set when a fetch gave up on transient errors (the server is down or unreachable),
    /// for one fetch timeout: meanwhile fetches make one attempt and fail at once instead
    /// of each waiting out its own deadline (a read(2) that needs several fetches would
    /// wait several timeouts). A success clears it.
    down_until: std::sync::Mutex<Option<Instant>>,
    fail_fast_for: Duration,
}

/// A `Range` header value for bytes `[start, end)`.
pub fn range_header(start: u64, end: u64) -> String {
    format!("bytes={start}-{}", end - 1)
}

/// An error from one request: connection problems, timeouts and server-side trouble
/// (5xx, 408, 429) may pass; other statuses, bad URLs and certificates will not.
pub fn classify(url: &str, e: ureq::Error) -> Failure {
    match e {
        ureq::Error::Status(code, _) if code >= 500 || code == 408 || code == 429 => {
            Failure::Transient(format!("{url}: HTTP {code}"))
        }
        ureq::Error::Status(code, r) => Failure::Permanent(format!("{url}: HTTP {code} {}", r.status_text())),
        ureq::Error::Transport(t) => {
            use ureq::ErrorKind::*;
            let msg = format!("{url}: {t}");
            // a bad URL or a certificate the server will keep presenting: no use retrying
            if matches!(
                t.kind(),
                InvalidUrl | UnknownScheme | TooManyRedirects | InsecureRequestHttpsOnly
            ) || msg.contains("certificate")
            {
                Failure::Permanent(msg)
            } else {
                Failure::Transient(msg)
            }
        }
    }
}

impl Http {
    /// `read_timeout` bounds each wait for bytes (whole-file downloads have no overall
    /// deadline, a stalled one fails after this long).
    pub fn new(counters: Arc<Counters>, read_timeout: Duration) -> Http {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(read_timeout.min(Duration::from_secs(10)))
            .timeout_read(read_timeout)
            .redirects(8)
            .max_idle_connections_per_host(16)
            .user_agent(concat!("ublkd/", env!("CARGO_PKG_VERSION")))
            .build();
        Http {
            agent,
            counters,
            down_until: std::sync::Mutex::new(None),
            fail_fast_for: read_timeout,
        }
    }

    /// One GET (counted as a request; failed ones as fetch errors).
    pub fn get(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<ureq::Response, Box<ureq::Error>> {
        let mut req = self.agent.get(url);
        for (k, v) in headers {
            req = req.set(k, v);
        }
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        Counters::add(&self.counters.fetch_requests, 1);
        req.call().map_err(Box::new)
    }

    /// Run `attempt` (given the time left) until it succeeds, fails permanently or the
    /// deadline passes; transient failures back off 50 ms, 100 ms, ... 2 s. Each failed
    /// attempt is counted in `fetch_errors`, each success's latency recorded.
    pub fn retry<T>(
        &self,
        what: &str,
        deadline: Instant,
        mut attempt: impl FnMut(Duration) -> Result<T, Failure>,
    ) -> Result<T, String> {
        let mut backoff = Duration::from_millis(50);
        let mut tries = 0u32;
        let down = self.down_until.lock().unwrap().is_some_and(|t| Instant::now() < t);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *self.down_until.lock().unwrap() = Some(Instant::now() + self.fail_fast_for);
                return Err(format!("{what}: no answer within the fetch timeout"));
            }
            let t0 = Instant::now();
            tries += 1;
            match attempt(left) {
                Ok(v) => {
                    self.counters.record_latency(t0.elapsed());
                    *self.down_until.lock().unwrap() = None;
                    return Ok(v);
                }
                Err(f) => {
                    Counters::add(&self.counters.fetch_errors, 1);
                    log::warn!("{what}: attempt {tries}: {}", f.message());
                    match f {
                        Failure::Permanent(m) => return Err(m),
                        Failure::Transient(m) if down => {
                            return Err(format!("{m} (failing fast: an earlier fetch timed out)"));
                        }
                        Failure::Transient(m) => {
                            let left = deadline.saturating_duration_since(Instant::now());
                            if left <= backoff {
                                *self.down_until.lock().unwrap() = Some(Instant::now() + self.fail_fast_for);
                                return Err(format!("{m} (gave up after {tries} attempts: fetch timeout)"));
                            }
                            std::thread::sleep(backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
            }
        }
    }
}

/// The body of a response to a `Range: bytes=start-(start+len-1)` request: must be a 206
/// for exactly that range (a server that ignores ranges would send the whole pack).
pub fn range_body(
    url: &str,
    resp: ureq::Response,
    start: u64,
    len: u64,
    counters: &Counters,
) -> Result<Vec<u8>, Failure> {
    if resp.status() != 206 {
        return Err(Failure::Permanent(format!(
            "{url}: HTTP {} to a range request (the server does not serve byte ranges)",
            resp.status()
        )));
    }
    let want = format!("bytes {start}-{}/", start + len - 1);
    match resp.header("content-range") {
        Some(cr) if cr.starts_with(&want) => {}
        other => {
            return Err(Failure::Permanent(format!(
                "{url}: Content-Range {other:?}, asked for bytes {start}-{}",
                start + len - 1
            )))
        }
    }
    read_body(url, resp, len, counters)
}

/// Exactly `len` body bytes (counted in `fetch_bytes`); short or long bodies fail.
pub fn read_body(url: &str, resp: ureq::Response, len: u64, counters: &Counters) -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::with_capacity(len as usize);
    let r = resp.into_reader().take(len + 1).read_to_end(&mut buf);
    Counters::add(&counters.fetch_bytes, buf.len() as u64);
    match r {
        Err(e) => Err(Failure::Transient(format!("{url}: reading the body: {e}"))),
        Ok(_) if buf.len() as u64 != len => Err(Failure::Transient(format!(
            "{url}: body has {} bytes, expected {len}",
            buf.len()
        ))),
        Ok(_) => Ok(buf),
    }
}

/// A GET of an optional document: Ok(None) on 404.
pub fn fetch_optional(
    http: &Http,
    url: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Option<Vec<u8>>, String> {
    http.retry(url, Instant::now() + timeout, |left| {
        match http.get(url, headers, Some(left)).map_err(|e| *e) {
            Ok(r) => read_small(url, r, &http.counters).map(Some),
            Err(ureq::Error::Status(404, _)) => Ok(None),
            Err(e) => Err(classify(url, e)),
        }
    })
}

/// Bound of a JSON document fetched whole (manifests, a config blob, a trace).
pub const SMALL_MAX: u64 = 64 << 20;

/// A small JSON document (manifest.json, an OCI manifest, a trace): at most [`SMALL_MAX`].
pub fn read_small(url: &str, r: ureq::Response, counters: &Counters) -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::new();
    let res = r.into_reader().take(SMALL_MAX).read_to_end(&mut buf);
    Counters::add(&counters.fetch_bytes, buf.len() as u64);
    res.map_err(|e| Failure::Transient(format!("{url}: reading the body: {e}")))?;
    Ok(buf)
}
