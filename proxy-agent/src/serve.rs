//! What the agent serves over HTTP, as kube-proxy does:
//!
//! - [`endpoints`]: `/healthz`, `/livez`, `/metrics` and `/proxyMode` on
//!   `healthzBindAddress` and `metricsBindAddress`, and the server they share;
//! - [`health`]: the health those endpoints report (kube-proxy's rule);
//! - [`health_check_node_ports`]: one listener per `healthCheckNodePort` of
//!   this node, for cloud load balancers.
pub mod endpoints;
pub mod health;
pub mod health_check_node_ports;
