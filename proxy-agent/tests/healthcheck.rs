//! Health-check node port servers (kube-proxy's service health server):
//! reconcile opens, updates and closes listeners; 200/503 with kube-proxy's
//! body and headers; a port that cannot be bound is retried. Listeners are on
//! 127.0.0.1 ports found free.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, TcpListener},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use proxy_agent::{
    model::HealthCheck,
    serve::health_check_node_ports::{body, HealthCheckServers},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A port free on 127.0.0.1 now.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .expect("bind an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

fn hc(service: &str, n: usize) -> HealthCheck {
    HealthCheck {
        service: service.to_string(),
        local_endpoints: n,
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

/// `GET <path>` over HTTP/1.1 with `Connection: close`; the whole reply.
async fn get(port: u16, path: &str) -> std::io::Result<Reply> {
    let mut s = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)),
    )
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect"))??;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut raw))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "read"))??;
    let text = String::from_utf8(raw).expect("utf-8 reply");
    let (head, body) = text.split_once("\r\n\r\n").expect("header/body separator");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}

/// Waits (up to 2 s) until connecting to `port` is refused.
async fn wait_refused(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "port {port} still accepts connections 2 s after its close: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

#[test]
fn body_is_kube_proxys() {
    assert_eq!(
        body("default", "web", 2, true),
        "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
    );
    let v: serde_json::Value = serde_json::from_str(&body("ns", "lb", 0, false)).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"service": {"namespace": "ns", "name": "lb"}, "localEndpoints": 0, "serviceProxyHealthy": false})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_opens_updates_and_closes() {
    let (p1, p2) = (free_port(), free_port());
    let mut servers = HealthCheckServers::new(LOCALHOST);

    // Open two: one with local endpoints (200), one without (503).
    let mut checks = BTreeMap::from([(p1, hc("default/web", 2)), (p2, hc("prod/api", 0))]);
    let r = servers.sync(&checks);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.opened.len(), 2);
    assert_eq!(servers.ports(), {
        let mut v = vec![p1, p2];
        v.sort();
        v
    });

    let a = get(p1, "/").await.expect("GET / on p1");
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(
        a.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
    assert_eq!(
        a.headers.get("x-content-type-options").map(String::as_str),
        Some("nosniff")
    );
    assert_eq!(
        a.headers
            .get("x-load-balancing-endpoint-weight")
            .map(String::as_str),
        Some("2")
    );
    assert_eq!(a.body, body("default", "web", 2, true));
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["service"]["namespace"], "default");
    assert_eq!(v["service"]["name"], "web");
    assert_eq!(v["localEndpoints"], 2);
    assert_eq!(v["serviceProxyHealthy"], true);

    let b = get(p2, "/").await.expect("GET / on p2");
    assert_eq!(b.status, 503, "{b:?}");
    assert_eq!(b.body, body("prod", "api", 0, true));
    assert_eq!(
        b.headers.get("x-content-type-options").map(String::as_str),
        Some("nosniff")
    );

    // kube-proxy's handler answers every path (probes use / or /healthz).
    let c = get(p1, "/healthz").await.expect("GET /healthz");
    assert_eq!(c.status, 200);

    // Same sync again: nothing to do.
    let r = servers.sync(&checks);
    assert!(
        r.opened.is_empty() && r.updated.is_empty() && r.closed.is_empty() && r.errors.is_empty(),
        "{r:?}"
    );

    // Counts change in place: p1 loses its endpoints, p2 gains one.
    checks.insert(p1, hc("default/web", 0));
    checks.insert(p2, hc("prod/api", 1));
    let r = servers.sync(&checks);
    assert_eq!(r.updated.len(), 2, "{r:?}");
    assert!(r.opened.is_empty() && r.closed.is_empty(), "{r:?}");
    let a = get(p1, "/").await.unwrap();
    assert_eq!(
        (a.status, a.body.as_str()),
        (503, body("default", "web", 0, true).as_str())
    );
    let b = get(p2, "/").await.unwrap();
    assert_eq!(
        (b.status, b.body.as_str()),
        (200, body("prod", "api", 1, true).as_str())
    );

    // Another Service takes p1 over (the old one deleted, port reused).
    checks.insert(p1, hc("other/svc", 3));
    servers.sync(&checks);
    let a = get(p1, "/").await.unwrap();
    assert_eq!(
        (a.status, a.body.as_str()),
        (200, body("other", "svc", 3, true).as_str())
    );

    // p2's Service goes (deleted, or eTP back to Cluster): closed.
    checks.remove(&p2);
    let r = servers.sync(&checks);
    assert_eq!(r.closed, vec![p2]);
    wait_refused(p2).await;
    assert_eq!(servers.ports(), vec![p1]);

    // It comes back on the same port: opened again.
    checks.insert(p2, hc("prod/api", 1));
    let r = servers.sync(&checks);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.opened, vec![p2]);
    assert_eq!(get(p2, "/").await.unwrap().status, 200);

    // Nothing left: every listener closed.
    let r = servers.sync(&BTreeMap::new());
    assert_eq!(r.closed.len(), 2);
    wait_refused(p1).await;
    wait_refused(p2).await;
    assert!(servers.ports().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbindable_port_is_retried_at_the_next_sync() {
    // Someone else holds the port.
    let squatter = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = squatter.local_addr().unwrap().port();
    let ok_port = free_port();
    let mut servers = HealthCheckServers::new(LOCALHOST);
    let checks = BTreeMap::from([(port, hc("default/lb", 1)), (ok_port, hc("default/ok", 1))]);

    let r = servers.sync(&checks);
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert_eq!(r.errors[0].0, port);
    assert_eq!(r.errors[0].1.kind(), std::io::ErrorKind::AddrInUse);
    // The other port is served regardless.
    assert_eq!(r.opened, vec![ok_port]);
    assert_eq!(get(ok_port, "/").await.unwrap().status, 200);

    // Still taken: still an error, no crash.
    let r = servers.sync(&checks);
    assert_eq!(r.errors.len(), 1, "{r:?}");

    // Released: the next sync opens it.
    drop(squatter);
    let r = servers.sync(&checks);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.opened, vec![port]);
    let a = get(port, "/").await.unwrap();
    assert_eq!(
        (a.status, a.body.as_str()),
        (200, body("default", "lb", 1, true).as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_proxy_answers_503() {
    let port = free_port();
    let healthy = Arc::new(AtomicBool::new(true));
    let h = healthy.clone();
    let mut servers =
        HealthCheckServers::new(LOCALHOST).with_proxy_health(move || h.load(Ordering::SeqCst));
    servers.sync(&BTreeMap::from([(port, hc("default/web", 1))]));
    assert_eq!(get(port, "/").await.unwrap().status, 200);
    healthy.store(false, Ordering::SeqCst);
    let a = get(port, "/").await.unwrap();
    assert_eq!(
        (a.status, a.body.as_str()),
        (503, body("default", "web", 1, false).as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_closes_every_listener() {
    let (p1, p2) = (free_port(), free_port());
    let mut servers = HealthCheckServers::new(LOCALHOST);
    servers.sync(&BTreeMap::from([(p1, hc("a/x", 1)), (p2, hc("b/y", 0))]));
    assert_eq!(get(p1, "/").await.unwrap().status, 200);
    drop(servers);
    wait_refused(p1).await;
    wait_refused(p2).await;
}

/// Issue 15: the agent's HTTP servers have a connection limit and header-read
/// and idle timeouts. Connections that send nothing fill the limit: one more
/// is refused at once with a 503 (never left hanging), the silent ones are
/// closed after the header timeout, then a request is served; a trickling
/// request head and an idle keep-alive connection are closed too.
#[tokio::test]
async fn slowloris_connections_are_limited_and_timed_out() {
    use proxy_agent::serve::endpoints::{health_router, serve_with, ServerLimits};
    let limits = ServerLimits {
        header_read_timeout: Duration::from_millis(400),
        idle_timeout: Duration::from_millis(600),
        max_connections: 4,
    };
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let health = Arc::new(proxy_agent::serve::health::Health::new(
        Duration::from_secs(60),
    ));
    let server = tokio::spawn(serve_with(listener, health_router(health), limits));

    let connect = || tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port));
    // Reads until the peer closes; how long that took (None: still open).
    async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> Option<Duration> {
        let start = Instant::now();
        let mut buf = [0u8; 512];
        loop {
            match tokio::time::timeout(within.saturating_sub(start.elapsed()), s.read(&mut buf))
                .await
            {
                Err(_) => return None,
                Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
                Ok(Ok(_)) => {}
            }
        }
    }

    let mut silent = Vec::new();
    for _ in 0..limits.max_connections {
        silent.push(connect().await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Over the limit: refused cleanly and at once.
    let mut extra = connect().await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(1), extra.read_to_end(&mut raw))
        .await
        .expect("the connection over the limit was left hanging")
        .ok();
    assert!(
        String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 503"),
        "{:?}",
        String::from_utf8_lossy(&raw)
    );
    // The silent ones are closed after the header-read timeout.
    for s in &mut silent {
        let t = closed_within(s, Duration::from_secs(3)).await;
        assert!(t.is_some(), "a silent connection was never closed");
    }
    // Then a well-formed request is served.
    let reply = get(port, "/livez").await.unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    // A request head sent a byte at a time is cut at the header timeout.
    let mut slow = connect().await.unwrap();
    let trickle = async {
        for b in b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if slow.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), trickle)
        .await
        .ok();
    assert!(
        closed_within(&mut slow, Duration::from_secs(2))
            .await
            .is_some(),
        "a trickling request head was never cut"
    );

    // A keep-alive connection is served, then closed once idle.
    let mut keep = connect().await.unwrap();
    keep.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(2), keep.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t = closed_within(&mut keep, Duration::from_secs(3)).await;
    assert!(
        t.is_some(),
        "an idle keep-alive connection was never closed"
    );
    server.abort();
}
