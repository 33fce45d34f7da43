//! Health-check node ports: kube-proxy's service health server
//! (`pkg/proxy/healthcheck/service_health.go`).
//!
//! Every `type: LoadBalancer` Service with `externalTrafficPolicy: Local` has
//! a `healthCheckNodePort`; the cloud load balancer probes it on every node to
//! learn which nodes hold local endpoints. For each such port in
//! [`DesiredState::health_checks`](crate::model::DesiredState) this module
//! keeps one HTTP listener (by default on `0.0.0.0:<port>` in the node's
//! network namespace, as kube-proxy binds without `nodePortAddresses`) that
//! answers every request, whatever its path or method, as kube-proxy does:
//!
//! - `200 OK` while the Service has local ready endpoints on this node and the
//!   proxy is healthy, `503 Service Unavailable` otherwise;
//! - headers `Content-Type: application/json`, `X-Content-Type-Options:
//!   nosniff` and `X-Load-Balancing-Endpoint-Weight: <local endpoints>`;
//! - kube-proxy's body, byte for byte (see [`body`]).
//!
//! [`HealthCheckServers::sync`] is called after every sync: it opens
//! listeners for new ports, updates the counts of existing ones in place (no
//! rebind, so probes never see a refused connection because a count
//! changed), and closes those whose Service went away or stopped needing a
//! health check. A port that cannot be bound is logged and retried at the
//! next sync; it never stops the agent.
use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, RwLock},
};

use axum::{
    extract::State,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Router,
};
use tokio::task::JoinHandle;
use tracing::{error, info};

use crate::model::HealthCheck;

/// Header kube-proxy sets to the local endpoint count.
pub const ENDPOINT_WEIGHT_HEADER: &str = "X-Load-Balancing-Endpoint-Weight";

/// Whether the proxy itself is healthy (kube-proxy's `healthzServer.IsHealthy`):
/// reported as `serviceProxyHealthy`, and a 503 when false.
pub type ProxyHealthy = Arc<dyn Fn() -> bool + Send + Sync>;

/// What one listener reports; updated in place by [`HealthCheckServers::sync`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Served {
    namespace: String,
    name: String,
    local_endpoints: usize,
}

impl Served {
    fn of(hc: &HealthCheck) -> Self {
        let (namespace, name) = hc
            .service
            .split_once('/')
            .unwrap_or(("default", hc.service.as_str()));
        Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
            local_endpoints: hc.local_endpoints,
        }
    }
}

/// kube-proxy's body: a Go `%q`-quoted, dedented JSON document with tab
/// indentation and no trailing newline.
pub fn body(namespace: &str, name: &str, local_endpoints: usize, proxy_healthy: bool) -> String {
    // Go's %q and JSON strings agree for the characters Kubernetes names may
    // hold (DNS labels); serde_json quotes anything else safely.
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        q(namespace),
        q(name),
        local_endpoints,
        proxy_healthy
    )
}

#[derive(Clone)]
struct HandlerState {
    served: Arc<RwLock<Served>>,
    proxy_healthy: ProxyHealthy,
}

async fn handle(State(s): State<HandlerState>) -> Response {
    let served = s.served.read().expect("health-check state lock").clone();
    let healthy = (s.proxy_healthy)();
    let status = if served.local_endpoints > 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut resp = (
        status,
        body(
            &served.namespace,
            &served.name,
            served.local_endpoints,
            healthy,
        ),
    )
        .into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        ENDPOINT_WEIGHT_HEADER,
        HeaderValue::from(served.local_endpoints as u64),
    );
    resp
}

struct Listener {
    served: Arc<RwLock<Served>>,
    task: JoinHandle<()>,
}

/// What one [`HealthCheckServers::sync`] did.
#[derive(Debug, Default)]
pub struct HealthCheckReport {
    /// Ports whose listener was opened.
    pub opened: Vec<u16>,
    /// Ports whose Service or count changed (listener kept).
    pub updated: Vec<u16>,
    /// Ports whose listener was closed.
    pub closed: Vec<u16>,
    /// Ports that could not be bound (retried at the next sync).
    pub errors: Vec<(u16, io::Error)>,
}

/// The health-check listeners of this node. Needs a Tokio runtime: `sync`
/// spawns the servers on the current one.
pub struct HealthCheckServers {
    bind: IpAddr,
    proxy_healthy: ProxyHealthy,
    listeners: BTreeMap<u16, Listener>,
}

impl Default for HealthCheckServers {
    fn default() -> Self {
        Self::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }
}

impl HealthCheckServers {
    /// Listeners on `bind:<port>` (kube-proxy: every node address, i.e.
    /// `0.0.0.0`), reporting a healthy proxy.
    pub fn new(bind: IpAddr) -> Self {
        Self {
            bind,
            proxy_healthy: Arc::new(|| true),
            listeners: BTreeMap::new(),
        }
    }

    /// Reports `f()` as `serviceProxyHealthy` (and 503 when false).
    pub fn with_proxy_health(mut self, f: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.proxy_healthy = Arc::new(f);
        self
    }

    /// The ports with an open listener.
    pub fn ports(&self) -> Vec<u16> {
        self.listeners.keys().copied().collect()
    }

    fn open(&self, port: u16, served: Served) -> io::Result<Listener> {
        let addr = SocketAddr::new(self.bind, port);
        // Bound synchronously so that the error is known now. SO_REUSEADDR as
        // Go's listeners set it: a port released by a closed listener with
        // connections in TIME_WAIT can be bound again at once.
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(1024)?;
        let served = Arc::new(RwLock::new(served));
        let state = HandlerState {
            served: served.clone(),
            proxy_healthy: self.proxy_healthy.clone(),
        };
        let router = Router::new().fallback(handle).with_state(state);
        let task = tokio::spawn(async move {
            if let Err(e) = crate::serve::endpoints::serve(listener, router).await {
                error!(port, error = %e, "health-check node port server stopped");
            }
        });
        Ok(Listener { served, task })
    }

    /// Makes the listeners match `checks` (see the module documentation).
    pub fn sync(&mut self, checks: &BTreeMap<u16, HealthCheck>) -> HealthCheckReport {
        let mut report = HealthCheckReport::default();
        let gone: Vec<u16> = self
            .listeners
            .keys()
            .filter(|p| !checks.contains_key(p))
            .copied()
            .collect();
        for port in gone {
            if let Some(l) = self.listeners.remove(&port) {
                l.task.abort();
                info!(port, "health-check node port closed");
                report.closed.push(port);
            }
        }
        for (&port, hc) in checks {
            let want = Served::of(hc);
            if let Some(l) = self.listeners.get(&port) {
                // A server whose task ended (it should not) is reopened.
                if !l.task.is_finished() {
                    let mut cur = l.served.write().expect("health-check state lock");
                    if *cur != want {
                        *cur = want;
                        report.updated.push(port);
                    }
                    continue;
                }
                self.listeners.remove(&port);
            }
            match self.open(port, want) {
                Ok(l) => {
                    info!(port, service = %hc.service, local_endpoints = hc.local_endpoints, "health-check node port open");
                    self.listeners.insert(port, l);
                    report.opened.push(port);
                }
                Err(e) => {
                    error!(port, service = %hc.service, error = %e, "cannot open the health-check node port; retrying at the next sync");
                    report.errors.push((port, e));
                }
            }
        }
        report
    }

    /// Closes every listener.
    pub fn shutdown(&mut self) {
        for (_, l) in std::mem::take(&mut self.listeners) {
            l.task.abort();
        }
    }
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        self.shutdown();
    }
}
