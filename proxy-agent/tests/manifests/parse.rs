//! Loading files and documents: multi-document YAML and JSON, directories,
//! bad documents, fuzzing, trimming, deep nesting, byte-order marks,
//! thousands of documents, duplicates.
use proxy_agent::objects::Snapshot;
use proxy_agent::sources::manifests::{self, load_paths, load_str};
use proxy_testkit::fuzz;

use super::*;

#[test]
fn multi_document_file_loads_every_known_kind_and_skips_others() {
    let (snap, errors) = load_paths(&[data("example.yaml")]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(names(&snap.services), ["default/my-service"]);
    assert_eq!(names(&snap.pods), ["default/my-app-1", "default/my-app-2"]);
    assert!(snap.endpoint_slices.is_empty() && snap.nodes.is_empty());
}

#[test]
fn directory_reads_yaml_yml_and_json_sorted_and_lists_items() {
    let (snap, errors) = load_paths(&[data("dir")]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(names(&snap.services), ["prod/api"]);
    assert_eq!(names(&snap.endpoint_slices), ["prod/api-abc"]);
    assert_eq!(names(&snap.pods), ["prod/p1"]);
    assert_eq!(snap.nodes.len(), 1);
}

#[test]
fn bad_documents_are_reported_by_file_and_object_and_the_rest_loads() {
    let path = data("bad.yaml");
    let (snap, errors) = load_paths(std::slice::from_ref(&path));
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let file = path.display().to_string();

    // The good objects around the bad ones.
    assert_eq!(
        names(&snap.services),
        ["shop/good", "default/headless", "default/external"]
    );
    assert_eq!(names(&snap.pods), ["default/survivor"]);
    assert_eq!(snap.nodes.len(), 1);

    assert_eq!(errors.len(), 4, "{messages:#?}");
    assert_eq!(
        messages[0],
        format!("{file}: document 2 (Service default/web): spec.ports[0].port: invalid type: string \"x\", expected i32")
    );
    assert_eq!(errors[0].document, Some(2));
    assert!(
        messages[1].starts_with(&format!("{file}: document 4: ")),
        "{}",
        messages[1]
    );
    assert!(
        messages[1].contains("line 29 column 18"),
        "syntax error located in the file: {}",
        messages[1]
    );
    assert!(
        messages[2].starts_with(&format!("{file}: document 5")),
        "{}",
        messages[2]
    );
    assert!(messages[2].contains("kind"), "{}", messages[2]);
    assert_eq!(
        messages[3],
        format!(
            "{file}: document 6 (Service default/no-cluster-ip): has no spec.clusterIP \
             (the manifests source does not allocate ClusterIPs)"
        )
    );
}

#[test]
fn service_without_cluster_ip_is_an_error_but_headless_and_external_name_are_not() {
    let yaml = "\
apiVersion: v1
kind: Service
metadata: {name: a}
spec:
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: b}
spec:
  clusterIP: None
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: c}
spec:
  type: ExternalName
  externalName: example.invalid
";
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errors);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].to_string(), "x.yaml: document 1 (Service default/a): has no spec.clusterIP (the manifests source does not allocate ClusterIPs)");
    assert_eq!(names(&snap.services), ["default/b", "default/c"]);
}

#[test]
fn empty_documents_and_comments_are_skipped_silently() {
    let yaml = "# leading comment\n---\n---\n# only a comment\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n}\n...\n";
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(snap.nodes.len(), 1);
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let (snap, errors) = load_paths(&[data("does-not-exist.yaml"), data("example.yaml")]);
    assert_eq!(errors.len(), 1);
    assert!(errors[0].to_string().contains("does-not-exist.yaml"));
    assert_eq!(snap.services.len(), 1);
}

/// Documents the fuzz tests start from: every kind the source reads, a List,
/// YAML and JSON.
const FUZZ_SEEDS: &[&str] = &[
    "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default, creationTimestamp: \"2024-01-01T00:00:00Z\"}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1]\n  externalIPs: [198.18.7.1]\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n  loadBalancerSourceRanges: [198.18.0.0/15]\n  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080, protocol: TCP}]\nstatus: {loadBalancer: {ingress: [{ip: 198.18.9.1, ipMode: VIP}]}}\n",
    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}]\nendpoints:\n  - addresses: [198.18.1.1]\n    nodeName: node-a\n    zone: z1\n    conditions: {ready: true, serving: true, terminating: false}\n    hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}\n",
    "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {app: web}}\nspec:\n  nodeName: node-a\n  containers: [{name: c, image: x, ports: [{name: http, containerPort: 8080}]}]\nstatus: {phase: Running, podIP: 198.18.1.2, podIPs: [{ip: 198.18.1.2}]}\n",
    "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.11}]}\n",
    "{\"apiVersion\": \"v1\", \"kind\": \"List\", \"items\": [{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {\"name\": \"j\"}, \"spec\": {\"clusterIP\": \"198.19.0.9\", \"ports\": [{\"port\": 53, \"protocol\": \"UDP\"}]}}]}\n",
];

/// A valid Service the fuzzed documents sit between.
const BYSTANDER: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: bystander-a, namespace: keep}\nspec: {clusterIP: 198.19.100.1, ports: [{port: 80}]}\n";

/// Issue 15, input fuzzing: random and mutated documents never panic the
/// manifests parser, every error names the file and document, and valid
/// documents before and after a broken one still load.
#[test]
fn fuzzed_documents_never_panic_and_spare_their_neighbours() {
    let path = Path::new("fuzz.yaml");
    for seed in 0..3000u64 {
        let mut rng = fuzz::Rng::new(seed);
        let doc = match rng.below(4) {
            0 => (0..rng.below(8) + 1)
                .map(|_| fuzz::random_string(&mut rng))
                .collect::<Vec<_>>()
                .join(if rng.below(2) == 0 { "\n" } else { " " }),
            1 => {
                let mut v: serde_json::Value =
                    yaml_serde::from_str(rng.pick::<&str>(FUZZ_SEEDS)).unwrap();
                fuzz::mutate_value(&mut rng, &mut v);
                serde_json::to_string(&v).unwrap()
            }
            _ => {
                let seed_doc = *rng.pick(FUZZ_SEEDS);
                fuzz::mutate_text(&mut rng, seed_doc)
            }
        };
        let text = format!(
            "{BYSTANDER}---\n{doc}\n---\n{}",
            BYSTANDER.replace("bystander-a", "bystander-b")
        );
        let mut snap = Snapshot::default();
        let mut errors = Vec::new();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            load_str(path, &text, &mut snap, &mut errors)
        }));
        assert!(result.is_ok(), "seed {seed}: panicked on {doc:?}");
        let services = names(&snap.services);
        for keep in ["keep/bystander-a", "keep/bystander-b"] {
            assert!(
                services.iter().any(|s| s == keep),
                "seed {seed}: {keep} lost beside {doc:?}: {errors:?}"
            );
        }
        for e in &errors {
            let shown = e.to_string();
            assert!(
                shown.contains("fuzz.yaml") && !e.message.trim().is_empty(),
                "seed {seed}: unclear error {shown:?}"
            );
        }
    }
}

/// The same namespace/name in two files (or twice in one) is a warning naming
/// both files; the first one read (files sorted by name) is kept, whatever
/// order the directory lists them in, and the other objects are untouched.
#[test]
fn a_duplicate_service_is_a_warning_naming_both_files_and_the_first_wins() {
    let svc = |name: &str, ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // b.yaml written first: the winner is decided by name, not by creation.
    std::fs::write(
        dir.join("b.yaml"),
        format!(
            "{}---\n{}",
            svc("web", "198.19.0.20"),
            svc("other", "198.19.0.30")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("a.yaml"),
        format!(
            "{}---\n{}",
            svc("web", "198.19.0.10"),
            svc("web", "198.19.0.11")
        ),
    )
    .unwrap();
    let (snap, errors) = load_paths(&[dir.to_path_buf()]);
    assert_eq!(names(&snap.services), ["shop/web", "shop/other"]);
    let ip = |i: usize| snap.services[i].spec.as_ref().unwrap().cluster_ip.clone();
    assert_eq!(
        ip(0).as_deref(),
        Some("198.19.0.10"),
        "a.yaml's first copy wins"
    );
    assert_eq!(
        ip(1).as_deref(),
        Some("198.19.0.30"),
        "its neighbour is untouched"
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().all(|e| e.duplicate));
    let (a, b) = (dir.join("a.yaml"), dir.join("b.yaml"));
    let within = errors[0].to_string();
    assert!(
        within.contains("Service shop/web")
            && within.contains(&format!("read twice from {}", a.display())),
        "{within}"
    );
    let across = errors[1].to_string();
    assert!(
        across.contains("Service shop/web")
            && across.contains(&format!("already read from {}", a.display()))
            && across.contains(&format!("(in {})", b.display())),
        "{across}"
    );
    // Being reported does not make keep_last_good carry anything.
    let mut again = snap.clone();
    assert_eq!(manifests::keep_last_good(&snap, &errors, &mut again), 0);
    assert_eq!(again.services.len(), 2);
}

/// JSON documents take a faster parser: the same objects as the YAML path,
/// and a bad one still gets the YAML path's error naming the field.
#[test]
fn json_documents_load_as_their_yaml_form_does() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","labels":{"a":"b"}},"spec":{"clusterIP":"198.19.0.1","ports":[{"name":"http","port":80,"targetPort":8080}]}}
---
{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-1","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4","endpoints":[{"addresses":["198.18.1.1"],"conditions":{"ready":true},"nodeName":"n"}],"ports":[{"name":"http","port":8080}]}
"#;
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: web, labels: {a: b}}\nspec: {clusterIP: 198.19.0.1, ports: [{name: http, port: 80, targetPort: 8080}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [198.18.1.1], conditions: {ready: true}, nodeName: n}]\nports: [{name: http, port: 8080}]\n";
    let load = |text: &str| {
        let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
        load_str(Path::new("x.yaml"), text, &mut snap, &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        snap
    };
    let (j, y) = (load(json), load(yaml));
    assert_eq!(j.services, y.services);
    assert_eq!(j.endpoint_slices, y.endpoint_slices);
    assert_eq!(j.services[0].metadata.namespace.as_deref(), Some("default"));

    let bad = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":"eighty"}]}}"#;
    let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
    load_str(Path::new("x.yaml"), bad, &mut snap, &mut errs);
    assert!(snap.services.is_empty());
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0].message.contains("spec.ports[0].port"),
        "{}",
        errs[0]
    );
}

/// Objects dumped with `kubectl get -o yaml` carry `managedFields` and the
/// last applied configuration, often most of their size: the manifests
/// source keeps neither (as the Kubernetes source), in both its JSON and
/// YAML paths, and keeps the annotations the agent reads. Of a slice's
/// endpoints it keeps what the model reads (the first address, no
/// `targetRef`, `hostname` or `deprecatedTopology`).
#[test]
fn objects_are_trimmed_of_what_the_agent_never_reads() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: '{\"big\": true}'\n    proxy-agent.io/lb-algorithm: maglev\n  managedFields: [{manager: kubectl, operation: Apply}]\nspec: {clusterIP: 198.19.0.1, ports: [{port: 80}]}\n";
    let json = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-1","labels":{"kubernetes.io/service-name":"web"},"annotations":{"endpoints.kubernetes.io/last-change-trigger-time":"2030-01-01T00:00:00Z","other":"x"},"managedFields":[{"manager":"kube-controller-manager","operation":"Update"}]},"addressType":"IPv4","endpoints":[{"addresses":["198.18.1.1","198.18.1.9"],"hostname":"web-0","targetRef":{"kind":"Pod","namespace":"default","name":"web-0"},"deprecatedTopology":{"a":"b"}}],"ports":[]}"#;
    let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errs);
    load_str(Path::new("y.json"), json, &mut snap, &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    let svc = &snap.services[0].metadata;
    let slice = &snap.endpoint_slices[0].metadata;
    for m in [svc, slice] {
        assert!(
            m.managed_fields.as_ref().is_none_or(|f| f.is_empty()),
            "{m:?}"
        );
    }
    let keys = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        m.annotations
            .iter()
            .flat_map(|a| a.keys().cloned())
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(svc), ["proxy-agent.io/lb-algorithm"]);
    assert_eq!(
        keys(slice),
        ["endpoints.kubernetes.io/last-change-trigger-time"]
    );
    let e = &snap.endpoint_slices[0].endpoints[0];
    assert_eq!(e.addresses, ["198.18.1.1"]);
    assert!(
        e.target_ref.is_none() && e.hostname.is_none() && e.deprecated_topology.is_none(),
        "{e:?}"
    );
}

/// A document of brackets nested thousands deep is refused with an error
/// that says so, at the line where it goes too deep, before the YAML parser
/// reads it (whose scanner takes time growing with the square of the depth
/// to refuse it); the file's other documents load. Neither an odd quote in
/// a plain value nor closing brackets in quoted strings hide the nesting.
#[test]
fn brackets_nested_thousands_deep_are_refused_and_the_other_documents_load() {
    let svc = |name: &str, extra: &str, ports: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n{extra}spec:\n  clusterIP: 198.19.0.1\n  ports: {ports}\n")
    };
    let deep = svc(
        "deep",
        "",
        &format!("{}{}", "[".repeat(5_000), "]".repeat(5_000)),
    );
    // An apostrophe in a plain value does not open a quoted string.
    let apostrophe = svc(
        "apostrophe",
        "  annotations:\n    owner: o'brien\n",
        &format!("{}{}", "[".repeat(2_000), "]".repeat(2_000)),
    );
    // `"]"` is a string: it closes nothing.
    let quoted_closers = svc("closers", "", &format!("{}]", "[ \"]\", ".repeat(1_500)));
    // Brackets in quoted strings and comments, well under the limit.
    let b = "[".repeat(300);
    let quoted = svc(
        "quoted",
        &format!("  annotations:\n    a: \"{b}\"\n    b: '{b}'\n# {b}\n"),
        "[{port: 80}]",
    );
    let good = svc("good", "", "[{port: 80}]");
    let text = [good.as_str(), &deep, &apostrophe, &quoted_closers, &quoted].join("---\n");
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("m.yaml"), &text, &mut snap, &mut errors);
    assert_eq!(names(&snap.services), ["default/good", "default/quoted"]);
    assert_eq!(errors.len(), 3, "{errors:?}");
    let at: Vec<(Option<usize>, &str)> = errors
        .iter()
        .map(|e| (e.document, e.message.as_str()))
        .collect();
    let too_deep = |line: usize| format!("line {line}: brackets nested more than 1000 levels deep");
    assert_eq!(
        at,
        [
            (Some(2), too_deep(15).as_str()),
            (Some(3), too_deep(25).as_str()),
            (Some(4), too_deep(33).as_str()),
        ],
        "{errors:?}"
    );
}

/// A byte-order mark at the start of a file, or of a line where two files
/// were joined, is no content: every document loads.
#[test]
fn a_byte_order_mark_starting_a_file_or_a_joined_one_is_skipped() {
    let svc = |name: &str, ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  clusterIP: {ip}\n  ports:\n  - port: 80\n")
    };
    let bom = '\u{feff}';
    for text in [
        format!("{bom}{}", svc("a", "198.19.0.1")),
        format!("{bom}---\n{}", svc("a", "198.19.0.1")),
        format!(
            "{bom}{}---\n{bom}{}",
            svc("a", "198.19.0.1"),
            svc("b", "198.19.0.2")
        ),
    ] {
        let mut snap = Snapshot::default();
        let mut errors = Vec::new();
        load_str(Path::new("m.yaml"), &text, &mut snap, &mut errors);
        assert!(errors.is_empty(), "{text:?}: {errors:?}");
        let expected = if text.contains("name: b") {
            vec!["default/a", "default/b"]
        } else {
            vec!["default/a"]
        };
        assert_eq!(names(&snap.services), expected, "{text:?}");
    }
}

/// A file of thousands of documents is read on several threads: the
/// objects keep the file's order, and an error still names its document,
/// whichever chunk read it.
#[test]
fn a_file_of_thousands_of_documents_keeps_their_order_and_numbers() {
    let n = 5_000;
    let bad = 3_777;
    let mut text = String::new();
    for i in 0..n {
        let port = if i + 1 == bad { "eighty" } else { "80" };
        text.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}}}\nspec: {{clusterIP: 198.19.{}.{}, ports: [{{port: {port}}}]}}\n",
            i / 256,
            i % 256
        ));
    }
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("many.yaml"), &text, &mut snap, &mut errors);
    let names: Vec<String> = snap
        .services
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    let expected: Vec<String> = (0..n)
        .filter(|i| i + 1 != bad)
        .map(|i| format!("svc-{i}"))
        .collect();
    assert_eq!(names, expected);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].document, Some(bad));
    assert!(
        errors[0].to_string().contains(&format!("svc-{}", bad - 1)),
        "{}",
        errors[0]
    );
}
