//! kube-proxy's HTTP endpoints:
//!
//! - on `healthzBindAddress` (default `0.0.0.0:10256`): `/healthz` (sync loop
//!   keeps up and the node is eligible) and `/livez` (sync loop keeps up), with
//!   kube-proxy's JSON body, 200 or 503;
//! - on `metricsBindAddress` (default `127.0.0.1:10249`): `/metrics`
//!   (Prometheus text) and `/proxyMode` (`ebpf`);
//! - on `probeBindAddress` (default `127.0.0.1:10266`), the agent's own
//!   port, what `healthzBindAddress` serves, for the pod's probes: during a
//!   migration kube-proxy holds 10256 and 10249 until it is stopped.
//!
//! `/proxyMode` is served on both, as the e2e check of kube-proxy's URLs reads
//! it from the metrics port.
use std::{future::Future as _, net::SocketAddr, sync::Arc, time::Duration, time::SystemTime};

use axum::{
    extract::State,
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use tokio::net::TcpListener;
use tracing::{debug, error, info};

use crate::{metrics::Metrics, serve::health::Health};

/// What `/proxyMode` answers.
pub const PROXY_MODE: &str = "ebpf";

fn rfc3339(t: Option<SystemTime>) -> String {
    // Go's zero time, as kube-proxy prints a never-set lastUpdated.
    t.and_then(|t| jiff::Timestamp::try_from(t).ok())
        .map_or_else(|| "0001-01-01T00:00:00Z".to_string(), |t| t.to_string())
}

fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body.to_string(),
    )
        .into_response()
}

async fn healthz(State(h): State<Arc<Health>>) -> Response {
    let s = h.status();
    let ok = s.healthy && s.node_eligible;
    json(
        if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        serde_json::json!({
            "lastUpdated": rfc3339(s.last_updated),
            "currentTime": rfc3339(Some(s.current_time)),
            "nodeEligible": s.node_eligible,
        }),
    )
}

async fn livez(State(h): State<Arc<Health>>) -> Response {
    let s = h.status();
    json(
        if s.healthy {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        serde_json::json!({
            "lastUpdated": rfc3339(s.last_updated),
            "currentTime": rfc3339(Some(s.current_time)),
        }),
    )
}

/// The pod's readiness: 200 once the first complete sync is done (a
/// complete view of the source programmed and the programs attached), 503
/// before. Not kube-proxy's (it has none); `/healthz` keeps kube-proxy's rules
/// for load balancers.
async fn readyz(State(h): State<Arc<Health>>) -> Response {
    let ready = h.is_ready();
    json(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        serde_json::json!({ "ready": ready }),
    )
}

async fn proxy_mode() -> &'static str {
    PROXY_MODE
}

async fn metrics(State(m): State<Arc<Metrics>>) -> Response {
    // Reading the pinned stats map is a few syscalls; keep them off the
    // async workers anyway.
    let body = tokio::task::spawn_blocking(move || m.encode())
        .await
        .unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// `/healthz`, `/livez` and `/proxyMode`.
pub fn health_router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/proxyMode", get(proxy_mode))
        .with_state(health)
}

/// `/metrics` and `/proxyMode`.
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(self::metrics))
        .route("/proxyMode", get(proxy_mode))
        .with_state(metrics)
}

/// Connection limits of the agent's HTTP servers (health, metrics and
/// health-check node ports), so that clients holding connections open
/// (slowloris) neither block other clients for long nor grow memory without
/// bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// A request's head must arrive whole within this time of the
    /// connection's start (or of the previous response); else the
    /// connection is closed.
    pub header_read_timeout: Duration,
    /// A connection with no byte read or written for this long is closed
    /// (idle keep-alive connections included).
    pub idle_timeout: Duration,
    /// Connections served at once; one more is answered `503` and closed.
    pub max_connections: usize,
}

impl Default for ServerLimits {
    /// 10 s to send a request head, 60 s idle, 128 connections.
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 128,
        }
    }
}

/// What a connection beyond [`ServerLimits::max_connections`] gets.
const REFUSED: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// Serves `router` on `listener` with the default [`ServerLimits`] until the
/// task is dropped.
pub async fn serve(listener: TcpListener, router: Router) -> std::io::Result<()> {
    serve_with(listener, router, ServerLimits::default()).await
}

/// Serves `router` on `listener` (HTTP/1.1) within `limits` until the task is
/// dropped; connections are served in tasks of their own.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
) -> std::io::Result<()> {
    use tower_service::Service as _;
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait, as axum does.
                tracing::debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Refused at once, without reading: never blocks the loop.
            let _ = stream.try_write(REFUSED);
            continue;
        };
        let router = router.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let io = IdleTimeout::new(stream, limits.idle_timeout);
            let service = hyper::service::service_fn(move |req: axum::http::Request<_>| {
                let mut router = router.clone();
                async move { router.call(req.map(axum::body::Body::new)).await }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(hyper_util::rt::TokioIo::new(io), service);
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "connection ended");
            }
        });
    }
}

/// A stream that fails with `TimedOut` once nothing was read or written for
/// its timeout.
struct IdleTimeout {
    inner: tokio::net::TcpStream,
    timeout: Duration,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl IdleTimeout {
    fn new(inner: tokio::net::TcpStream, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    fn active(&mut self) {
        let at = tokio::time::Instant::now() + self.timeout;
        self.deadline.as_mut().reset(at);
    }

    fn expired(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.deadline.as_mut().poll(cx).is_ready()
    }
}

fn idle_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "idle connection closed")
}

impl tokio::io::AsyncRead for IdleTimeout {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.active();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }
}

impl tokio::io::AsyncWrite for IdleTimeout {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        match std::pin::Pin::new(&mut self.inner).poll_write(cx, data) {
            Poll::Ready(Ok(n)) => {
                self.active();
                Poll::Ready(Ok(n))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// How long a server that cannot bind waits before it tries again:
/// kube-proxy's `wait.Until(serve, 5*time.Second)`.
pub const BIND_RETRY: Duration = Duration::from_secs(5);

/// Binds `addr` and serves `router` in a task. As kube-proxy does by default
/// (`bindAddressHardFail: false`), a bind failure is logged and the agent
/// goes on, trying again every [`BIND_RETRY`]: during a takeover kube-proxy
/// holds the ports until it is stopped, and the node's `/healthz` must come
/// back once it is.
pub fn spawn(what: &'static str, addr: SocketAddr, router: Router) -> tokio::task::JoinHandle<()> {
    spawn_retrying(what, addr, router, BIND_RETRY)
}

fn spawn_retrying(
    what: &'static str,
    addr: SocketAddr,
    router: Router,
    retry: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut failed = false;
        loop {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    info!(server = what, address = %l.local_addr().unwrap_or(addr), "serving");
                    failed = false;
                    if let Err(e) = serve(l, router.clone()).await {
                        error!(server = what, error = %e, "server stopped; serving again in {retry:?}");
                    }
                }
                // Said once; the retries are quiet until it binds.
                Err(e) if !failed => {
                    failed = true;
                    error!(server = what, address = %addr, error = %e, "cannot bind; going on without it, trying again every {retry:?}");
                }
                Err(e) => debug!(server = what, address = %addr, error = %e, "cannot bind yet"),
            }
            tokio::time::sleep(retry).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn start(router: Router) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, router));
        addr
    }

    /// A plain HTTP/1.1 GET: (status, body).
    async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let (head, body) = buf.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_string(), body.to_string())
    }

    /// kube-proxy's servers try again until they bind: an agent started
    /// while kube-proxy still holds the port serves once it is gone.
    #[tokio::test]
    async fn a_port_in_use_is_served_once_it_is_free() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = holder.local_addr().unwrap();
        let h = Arc::new(Health::new(Duration::from_secs(60)));
        let server = spawn_retrying("healthz", addr, health_router(h), Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!server.is_finished(), "the server gave up");
        drop(holder);
        let mut status = None;
        for _ in 0..100 {
            if let Ok(Ok(s)) = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            {
                drop(s);
                status = Some(get(addr, "/healthz").await.0);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.abort();
        assert_eq!(status, Some(200), "never served once the port was free");
    }

    #[tokio::test]
    async fn healthz_and_livez_answer_kube_proxys_json() {
        let h = Arc::new(Health::new(Duration::from_secs(60)));
        let addr = start(health_router(h.clone())).await;
        let (status, head, body) = get(addr, "/healthz").await;
        assert_eq!(status, 200, "{body}");
        assert!(head
            .to_lowercase()
            .contains("content-type: application/json"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["nodeEligible"], true);
        for k in ["lastUpdated", "currentTime"] {
            let t = v[k].as_str().unwrap();
            t.parse::<jiff::Timestamp>()
                .unwrap_or_else(|e| panic!("{k} {t:?} is not RFC 3339: {e}"));
        }
        let (status, _, body) = get(addr, "/livez").await;
        assert_eq!(status, 200);
        assert!(body.contains("lastUpdated"));
        assert_eq!(get(addr, "/proxyMode").await.2, "ebpf");
    }

    #[tokio::test]
    async fn stalled_sync_gives_503_until_a_sync_completes() {
        let h = Arc::new(Health::new(Duration::from_millis(20)));
        let addr = start(health_router(h.clone())).await;
        h.queued_update();
        tokio::time::sleep(Duration::from_millis(60)).await;
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("\"lastUpdated\":\"0001-01-01T00:00:00Z\""),
            "{body}"
        );
        assert_eq!(get(addr, "/livez").await.0, 503);
        h.updated();
        assert_eq!(get(addr, "/healthz").await.0, 200);
    }

    #[tokio::test]
    async fn ineligible_node_fails_healthz_but_not_livez() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let h = Arc::new(Health::new(Duration::from_secs(60)));
        let addr = start(health_router(h.clone())).await;
        let mut node = k8s_openapi::api::core::v1::Node::default();
        node.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::now()));
        h.sync_node(Some(&node));
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(body.contains("\"nodeEligible\":false"), "{body}");
        assert_eq!(get(addr, "/livez").await.0, 200);
    }

    #[tokio::test]
    async fn metrics_and_proxy_mode_on_the_metrics_address() {
        let m = Arc::new(Metrics::new(Some("/nonexistent/proxy-agent-test".into())));
        m.observe_sync(Duration::from_millis(5), 0, 0, 0);
        let addr = start(metrics_router(m)).await;
        let (status, head, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(head.contains("text/plain; version=0.0.4"), "{head}");
        assert!(
            body.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram"),
            "{body}"
        );
        assert!(body.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"));
        let (status, _, body) = get(addr, "/proxyMode").await;
        assert_eq!((status, body.as_str()), (200, "ebpf"));
    }
}
