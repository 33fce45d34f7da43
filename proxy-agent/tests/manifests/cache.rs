//! The file cache behind the manifests source: what changed is named, the
//! first copy of an object kept, restored times and removed files seen.
use proxy_agent::sources::manifests::{self, load_paths};

use super::*;

/// The file cache behind the agent's manifests source: files whose time,
/// size and inode did not change are not read again, and only the objects
/// of changed files are named; the first file keeps an object two hold; a
/// document turned bad keeps its object; a file gone takes its objects.
#[test]
fn the_file_cache_names_only_what_changed() {
    use proxy_agent::model::{Change, Kind};
    let svc = |name: &str, ip: &str, port: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: {port}}}]}}\n")
    };
    let named = |changes: &[Change]| -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                Change::Applied(o) => format!("{:?} {}", o.kind(), o.key().1),
                Change::Deleted(k, key) => format!("{k:?} {} deleted", key.1),
            })
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![dir.path().to_path_buf()];
    let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    std::fs::write(
        &a,
        svc("web", "198.19.0.1", "80") + &svc("api", "198.19.0.2", "80"),
    )
    .unwrap();
    std::fs::write(&b, svc("db", "198.19.0.3", "80")).unwrap();
    let mut cache = manifests::FileCache::default();
    let (changes, errors) = cache.refresh(&paths);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        named(&changes),
        ["Service api", "Service db", "Service web"]
    );

    let (changes, errors) = cache.refresh(&paths);
    assert!(changes.is_empty() && errors.is_empty(), "nothing changed");

    // b changes: only its objects; one more, in a file of its own, held by a
    // too (a keeps it, b's copy is reported).
    std::fs::write(
        &b,
        svc("db", "198.19.0.3", "81") + &svc("web", "198.19.0.9", "80"),
    )
    .unwrap();
    let (changes, errors) = cache.refresh(&paths);
    assert_eq!(named(&changes), ["Service db", "Service web"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].duplicate && errors[0].message.contains("a.yaml"));
    let web = changes.iter().find_map(|c| match c {
        Change::Applied(proxy_agent::model::Object::Service(s)) if &*s.name == "web" => Some(s),
        _ => None,
    });
    assert_eq!(
        web.unwrap().spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("198.19.0.1"),
        "the first file's copy"
    );

    // api's document turns bad in a: no change for it (kept); web dropped
    // from a: b's copy takes over.
    std::fs::write(&a, svc("api", "198.19.0.2", "eighty")).unwrap();
    let (changes, errors) = cache.refresh(&paths);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(named(&changes), ["Service web"]);
    // Fixed: api applied again.
    std::fs::write(&a, svc("api", "198.19.0.2", "8080")).unwrap();
    let (changes, _) = cache.refresh(&paths);
    assert_eq!(named(&changes), ["Service api"]);

    // b removed: its objects are gone.
    std::fs::remove_file(&b).unwrap();
    let (changes, _) = cache.refresh(&paths);
    assert_eq!(
        named(&changes),
        ["Service db deleted", "Service web deleted"]
    );
    assert!(matches!(changes[0], Change::Deleted(Kind::Service, _)));
}

/// The file cache dedupes within one file as `load_paths` does: of a
/// Service written twice in one file the first copy is kept and the second
/// reported ("read twice"); an object of another kind with the same name is
/// no duplicate; later documents of the file are still read.
#[test]
fn the_file_cache_keeps_the_first_copy_of_an_object_a_file_holds_twice() {
    use proxy_agent::model::{Change, Object};
    let svc = |name: &str, ip: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
    };
    let slice = "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [198.18.1.1]}]\nports: [{port: 8080}]\n";
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    std::fs::write(
        &a,
        svc("web", "198.19.0.10")
            + slice
            + &svc("web", "198.19.0.11")
            + &svc("web", "198.19.0.12")
            + &svc("zz", "198.19.0.13"),
    )
    .unwrap();
    let mut cache = manifests::FileCache::default();
    let (changes, errors) = cache.refresh(&[dir.path().to_path_buf()]);
    assert_eq!(errors.len(), 2, "two later copies: {errors:?}");
    for e in &errors {
        let text = e.to_string();
        assert!(
            e.duplicate
                && text.contains("Service shop/web")
                && text.contains(&format!("read twice from {}", a.display())),
            "{text}"
        );
    }
    let services: Vec<(String, Option<String>)> = changes
        .iter()
        .filter_map(|c| match c {
            Change::Applied(Object::Service(s)) => Some((
                s.name.to_string(),
                s.spec
                    .as_ref()
                    .and_then(|p| p.cluster_ip.as_deref().map(String::from)),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        services,
        [
            ("web".to_string(), Some("198.19.0.10".to_string())),
            ("zz".to_string(), Some("198.19.0.13".to_string()))
        ],
        "the first copy, and the Service after the duplicates"
    );
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::Applied(Object::EndpointSlice(s)) if &*s.name == "web")),
        "the EndpointSlice named as the Service is no duplicate: {changes:?}"
    );
}

/// Found by review of the file cache: a change every stamp but the change
/// time hides (`cp -p`, `rsync -t --inplace`), a removed file whose bad
/// document kept its object, and a JSON document with a key twice (which the
/// YAML path refuses).
#[test]
fn the_file_cache_sees_restored_times_removed_bad_files_and_duplicate_json_keys() {
    use proxy_agent::model::Change;
    let svc = |name: &str, ip: &str, port: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: {port}}}]}}\n")
    };
    let named = |c: &[Change]| -> Vec<String> {
        c.iter()
            .map(|c| match c {
                Change::Applied(o) => format!("{:?} {}", o.kind(), o.key().1),
                Change::Deleted(k, key) => format!("{k:?} {} deleted", key.1),
            })
            .collect()
    };
    let past = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let set_mtime = |p: &Path| {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(past)
            .unwrap()
    };

    // Same length, modification time restored: the change time moved.
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![dir.path().to_path_buf()];
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, svc("web", "198.19.0.1", "80")).unwrap();
    set_mtime(&a);
    let mut cache = manifests::FileCache::default();
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web"]);
    std::fs::write(&a, svc("web", "198.19.0.2", "80")).unwrap();
    set_mtime(&a);
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web"]);

    // A bad document keeps its object; the file removed takes it.
    std::fs::write(&a, svc("web", "198.19.0.1", "eighty")).unwrap();
    assert!(cache.refresh(&paths).0.is_empty(), "kept");
    std::fs::remove_file(&a).unwrap();
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web deleted"]);

    // JSON with a key twice: refused, as its YAML form is.
    let j = dir.path().join("b.json");
    std::fs::write(&j, r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","clusterIP":"198.19.0.2","ports":[{"port":80}]}}"#).unwrap();
    let (snap, errors) = load_paths(std::slice::from_ref(&j));
    assert!(snap.services.is_empty(), "{:?}", snap.services);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].message.contains("duplicate"), "{}", errors[0]);

    // A document with a key twice loads nothing and is reported as such.
    let refused = |doc: &str, what: &str| {
        std::fs::write(&j, doc).unwrap();
        let (snap, errors) = load_paths(std::slice::from_ref(&j));
        assert!(snap.services.is_empty(), "{what}: {:?}", snap.services);
        assert!(
            errors[0].message.contains("duplicate"),
            "{what}: {}",
            errors[0]
        );
    };

    // At the top level too, `kind` (read before the object is) included;
    // an escaped `apiVersion` is still `v1`.
    for doc in [
        r#"{"apiVersion":"v1","kind":"Pod","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]}}"#,
        r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]},"spec":{"clusterIP":"198.19.0.2","ports":[{"port":80}]}}"#,
    ] {
        refused(doc, doc);
    }
    std::fs::write(&j, r#"{"apiVersion":"v\u0031","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]}}"#).unwrap();
    let (snap, errors) = load_paths(std::slice::from_ref(&j));
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(snap.services.len(), 1);

    // In an object of many keys too, and
    // with the second copy escaped: `\u006b0` is `k0`.
    let labels: Vec<String> = (0..40).map(|i| format!(r#""k{i}":"v""#)).collect();
    for dup in [r#""k0":"w""#, r#""\u006b0":"w""#, r#""k39":"w""#] {
        let doc = format!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"web","labels":{{{},{dup}}}}},"spec":{{"clusterIP":"198.19.0.1","ports":[{{"port":80}}]}}}}"#,
            labels.join(",")
        );
        refused(&doc, dup);
    }
    // Forty distinct keys load.
    std::fs::write(&j, format!(r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"web","labels":{{{}}}}},"spec":{{"clusterIP":"198.19.0.1","ports":[{{"port":80}}]}}}}"#, labels.join(","))).unwrap();
    let (snap, errors) = load_paths(&[j]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        snap.services[0].metadata.labels.as_ref().map(|l| l.len()),
        Some(40)
    );
}
