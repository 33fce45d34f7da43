//! Issue 15, input fuzzing of the model: mutated Services, EndpointSlices,
//! Pods and Nodes (through the manifests source, as JSON) never panic the
//! model, and a valid Service beside them keeps its frontend and backends.
use proxy_agent::model::{desired_state_with, ModelOptions};
use proxy_common::{IPPROTO_TCP, SCOPE_INTERNAL};

use super::*;

use proxy_testkit::fuzz;

const OBJECTS: &[&str] = &[
    "apiVersion: v1\nkind: Service\nmetadata: {name: web, creationTimestamp: \"2024-01-01T00:00:00Z\", annotations: {proxy-agent.io/lb-algorithm: maglev}}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1]\n  externalIPs: [198.18.7.1]\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Cluster\n  healthCheckNodePort: 30999\n  loadBalancerSourceRanges: [198.18.0.0/15]\n  selector: {app: web}\n  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080, protocol: TCP}]\nstatus: {loadBalancer: {ingress: [{ip: 198.18.9.1, ipMode: VIP}]}}\n",
    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}]\nendpoints:\n  - addresses: [198.18.1.1]\n    nodeName: node-a\n    zone: z1\n    conditions: {ready: true, serving: true, terminating: false}\n    hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}\n",
    "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {app: web}}\nspec:\n  nodeName: node-a\n  containers: [{name: c, image: x, ports: [{name: http, containerPort: 8080}]}]\nstatus: {phase: Running, podIP: 198.18.1.2, podIPs: [{ip: 198.18.1.2}], conditions: [{type: Ready, status: \"True\"}]}\n",
    "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.11}]}\n",
];

/// The Service that must not be disturbed, and its endpoints.
const BYSTANDER: &str = "---
apiVersion: v1
kind: Service
metadata: {name: bystander, namespace: keep, creationTimestamp: \"2000-01-01T00:00:00Z\"}
spec: {clusterIP: 198.19.100.1, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: bystander-1, namespace: keep, labels: {kubernetes.io/service-name: bystander}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [198.18.100.1], nodeName: node-a}]
";

#[test]
fn mutated_objects_never_panic_the_model_and_spare_a_valid_service() {
    let opts = ModelOptions {
        localhost_node_ports: true,
        ..Default::default()
    };
    for seed in 0..1500u64 {
        let mut rng = fuzz::Rng::new(seed);
        let mut docs = String::from(BYSTANDER);
        for _ in 0..rng.below(4) + 1 {
            let mut v: serde_json::Value = yaml_serde::from_str(rng.pick::<&str>(OBJECTS)).unwrap();
            fuzz::mutate_value(&mut rng, &mut v);
            let mut text = serde_json::to_string(&v).unwrap();
            // Now and then the mutated object names the bystander's
            // address as its externalIP / load-balancer IP.
            if rng.below(4) == 0 {
                text = text
                    .replace("198.18.7.1", "198.19.100.1")
                    .replace("198.18.9.1", "198.19.100.1");
            }
            docs.push_str("---\n");
            docs.push_str(&text);
            docs.push('\n');
        }
        let mut snapshot = proxy_agent::objects::Snapshot::default();
        let mut errors = Vec::new();
        load_str(Path::new("fuzz.yaml"), &docs, &mut snapshot, &mut errors);
        let outcome = std::panic::catch_unwind(|| desired_state_with(&snapshot, "node-a", &opts));
        let Ok((state, warnings)) = outcome else {
            panic!("seed {seed}: the model panicked on {docs}");
        };
        let fe = state
            .frontends
            .get(&key("198.19.100.1", 80, IPPROTO_TCP))
            .unwrap_or_else(|| panic!("seed {seed}: bystander lost: {warnings:?}\n{docs}"));
        assert_eq!(&*fe.service, "keep/bystander", "seed {seed}");
        assert_eq!(
            fe_at(&state, "198.19.100.1", 80, IPPROTO_TCP, SCOPE_INTERNAL)
                .backends
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>(),
            ["198.18.100.1:8080/TCP"],
            "seed {seed}: {docs}"
        );
        for w in &warnings {
            assert!(
                !w.object.is_empty() && !w.message.is_empty(),
                "seed {seed}: {w:?}"
            );
        }
    }
}
