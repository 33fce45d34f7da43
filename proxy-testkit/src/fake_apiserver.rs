//! A scripted Kubernetes API server for tests: list and watch of Services,
//! EndpointSlices and Nodes over plain HTTP on 127.0.0.1.
//!
//! What it speaks: lists with `metadata.resourceVersion`; `?watch=true`
//! streams of JSON lines (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`)
//! that replay every change after the requested resourceVersion; label
//! selectors (`k`, `!k`, `k=v`, `k==v`, `k!=v`) and field selectors
//! (`metadata.name=`, `metadata.namespace=`), with the API server's rule that
//! an object leaving a watch's selector is sent as `DELETED`.
//!
//! What a test can script: changes, hidden changes (logged but not sent to
//! open watches), an expired watch (`410 Gone`, which forces a relist),
//! connections dropped mid-stream, held lists, failing requests (500), and
//! the log of every request received.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Query, State},
    http::{StatusCode, Uri},
    response::{IntoResponse, Response},
    Router,
};
use futures::channel::mpsc;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Services,
    EndpointSlices,
    Nodes,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Services, Kind::EndpointSlices, Kind::Nodes];

    fn from_path(path: &str) -> Option<Kind> {
        match path {
            "/api/v1/services" => Some(Kind::Services),
            "/apis/discovery.k8s.io/v1/endpointslices" => Some(Kind::EndpointSlices),
            "/api/v1/nodes" => Some(Kind::Nodes),
            _ => None,
        }
    }

    fn from_object_kind(kind: &str) -> Kind {
        match kind {
            "Service" => Kind::Services,
            "EndpointSlice" => Kind::EndpointSlices,
            "Node" => Kind::Nodes,
            other => panic!("the fake API server does not serve {other}"),
        }
    }

    fn list_kind(self) -> (&'static str, &'static str) {
        match self {
            Kind::Services => ("v1", "ServiceList"),
            Kind::EndpointSlices => ("discovery.k8s.io/v1", "EndpointSliceList"),
            Kind::Nodes => ("v1", "NodeList"),
        }
    }
}

/// One request the server received.
#[derive(Clone, Debug)]
pub struct Request {
    pub kind: Option<Kind>,
    pub path: String,
    pub query: HashMap<String, String>,
}

impl Request {
    pub fn is_watch(&self) -> bool {
        matches!(
            self.query.get("watch").map(String::as_str),
            Some("true" | "1")
        )
    }
}

type Key = (String, String);

struct Change {
    rv: u64,
    kind: Kind,
    old: Option<Value>,
    new: Value,
    deleted: bool,
}

struct Watcher {
    kind: Kind,
    labels: String,
    fields: String,
    tx: mpsc::UnboundedSender<Result<Bytes, std::io::Error>>,
}

#[derive(Default)]
struct St {
    rv: u64,
    objects: HashMap<Kind, BTreeMap<Key, Value>>,
    log: Vec<Change>,
    compacted: HashMap<Kind, u64>,
    watchers: Vec<Watcher>,
    hidden: bool,
    fail: bool,
    held: HashMap<Kind, bool>,
    requests: Vec<Request>,
}

/// The fake API server; stops when dropped.
pub struct FakeApiServer {
    pub addr: SocketAddr,
    st: Arc<Mutex<St>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn key_of(obj: &Value) -> Key {
    let m = &obj["metadata"];
    (
        m["namespace"].as_str().unwrap_or("").to_string(),
        m["name"].as_str().expect("metadata.name").to_string(),
    )
}

/// Whether `obj` matches a label selector (kube's string syntax).
pub fn labels_match(selector: &str, obj: &Value) -> bool {
    let labels = obj["metadata"]["labels"].as_object();
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            if let Some(k) = term.strip_prefix('!') {
                get(k).is_none()
            } else if let Some((k, v)) = term.split_once("!=") {
                get(k) != Some(v)
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                get(k) == Some(v)
            } else {
                get(term).is_some()
            }
        })
}

/// Whether `obj` matches a field selector (`metadata.name`, `metadata.namespace`).
pub fn fields_match(selector: &str, obj: &Value) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            let (k, v, eq) = match term.split_once("!=") {
                Some((k, v)) => (k, v, false),
                None => {
                    let (k, v) = term
                        .split_once("==")
                        .or_else(|| term.split_once('='))
                        .unwrap_or_else(|| panic!("bad field selector {term:?}"));
                    (k, v, true)
                }
            };
            let actual = match k {
                "metadata.name" => obj["metadata"]["name"].as_str(),
                "metadata.namespace" => obj["metadata"]["namespace"].as_str(),
                other => panic!("the fake API server does not support the field {other}"),
            };
            (actual == Some(v)) == eq
        })
}

fn line(kind: &str, obj: &Value) -> Bytes {
    let mut s = json!({ "type": kind, "object": obj }).to_string();
    s.push('\n');
    Bytes::from(s)
}

fn expired_line() -> Bytes {
    line(
        "ERROR",
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": "too old resource version",
            "reason": "Expired", "code": 410
        }),
    )
}

impl Watcher {
    fn matches(&self, obj: &Value) -> bool {
        labels_match(&self.labels, obj) && fields_match(&self.fields, obj)
    }

    /// The event this watcher sees for a change, if any.
    fn event(&self, c: &Change) -> Option<Bytes> {
        if c.kind != self.kind {
            return None;
        }
        let was = c.old.as_ref().is_some_and(|o| self.matches(o));
        let is = self.matches(&c.new);
        if c.deleted {
            return was.then(|| line("DELETED", &c.new));
        }
        match (was, is) {
            (false, true) => Some(line("ADDED", &c.new)),
            (true, true) => Some(line("MODIFIED", &c.new)),
            (true, false) => Some(line("DELETED", &c.new)),
            (false, false) => None,
        }
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        [("content-type", "application/json")],
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "reason": reason, "message": message, "code": code.as_u16()
        })
        .to_string(),
    )
        .into_response()
}

async fn handle(
    State(st): State<Arc<Mutex<St>>>,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let kind = Kind::from_path(uri.path());
    let req = Request {
        kind,
        path: uri.path().to_string(),
        query,
    };
    let watch = req.is_watch();
    {
        let mut s = st.lock().unwrap();
        s.requests.push(req.clone());
        if s.fail {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "scripted failure",
            );
        }
    }
    let Some(kind) = kind else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the fake serves no such path",
        );
    };
    let labels = req.query.get("labelSelector").cloned().unwrap_or_default();
    let fields = req.query.get("fieldSelector").cloned().unwrap_or_default();
    if !watch {
        // A held list waits (the reflector stays unready meanwhile).
        while st.lock().unwrap().held.get(&kind).copied().unwrap_or(false) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let s = st.lock().unwrap();
        let items: Vec<&Value> = s
            .objects
            .get(&kind)
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|o| labels_match(&labels, o) && fields_match(&fields, o))
            .collect();
        let (api_version, list_kind) = kind.list_kind();
        let body = json!({
            "apiVersion": api_version, "kind": list_kind,
            "metadata": { "resourceVersion": s.rv.to_string() },
            "items": items,
        });
        return ([("content-type", "application/json")], body.to_string()).into_response();
    }

    let from: u64 = req
        .query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (tx, rx) = mpsc::unbounded();
    let w = Watcher {
        kind,
        labels,
        fields,
        tx,
    };
    {
        let mut s = st.lock().unwrap();
        if from < s.compacted.get(&kind).copied().unwrap_or(0) {
            let _ = w.tx.unbounded_send(Ok(expired_line()));
            drop(w);
        } else {
            // Replay and register under one lock: no change falls between.
            for c in s.log.iter().filter(|c| c.rv > from) {
                if let Some(ev) = w.event(c) {
                    let _ = w.tx.unbounded_send(Ok(ev));
                }
            }
            s.watchers.push(w);
        }
    }
    (
        [("content-type", "application/json")],
        Body::from_stream(rx),
    )
        .into_response()
}

impl FakeApiServer {
    pub async fn start() -> Self {
        let st = Arc::new(Mutex::new(St::default()));
        let app = Router::new().fallback(handle).with_state(st.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, st, task }
    }

    /// Serves on `listener`, already bound (for example inside another
    /// network namespace: the socket stays in the namespace it was made in).
    pub async fn start_on(listener: std::net::TcpListener) -> Self {
        Self::serve(Arc::new(Mutex::new(St::default())), listener)
    }

    /// Another server over the same objects and change log, on `listener`:
    /// what a restarted API server looks like to its clients (resumed
    /// watches replay what changed meanwhile). Stop the old one first, e.g.
    /// by dropping the runtime it served on (which closes its connections).
    pub async fn restart_on(&self, listener: std::net::TcpListener) -> Self {
        Self::serve(self.st.clone(), listener)
    }

    fn serve(st: Arc<Mutex<St>>, listener: std::net::TcpListener) -> Self {
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(handle).with_state(st.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, st, task }
    }

    /// A kubeconfig pointing at this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.addr
        )
    }

    fn record(&self, kind: Kind, old: Option<Value>, new: Value, deleted: bool) {
        let mut s = self.st.lock().unwrap();
        let c = Change {
            rv: s.rv,
            kind,
            old,
            new,
            deleted,
        };
        if !s.hidden {
            s.watchers.retain(|w| match w.event(&c) {
                Some(ev) => w.tx.unbounded_send(Ok(ev)).is_ok(),
                None => !w.tx.is_closed(),
            });
        }
        s.log.push(c);
    }

    /// Creates or replaces an object (its `kind` says where it goes).
    pub fn apply(&self, mut obj: Value) {
        let kind = Kind::from_object_kind(obj["kind"].as_str().expect("kind"));
        let key = key_of(&obj);
        let old = {
            let mut s = self.st.lock().unwrap();
            s.rv += 1;
            obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            s.objects.entry(kind).or_default().insert(key, obj.clone())
        };
        self.record(kind, old, obj, false);
    }

    /// Applies every document of a multi-document YAML text.
    pub fn apply_yaml(&self, text: &str) {
        for doc in yaml_serde::Deserializer::from_str(text) {
            let v: Value = serde::Deserialize::deserialize(doc).expect("YAML document");
            if !v.is_null() {
                self.apply(v);
            }
        }
    }

    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        let old = {
            let mut s = self.st.lock().unwrap();
            s.rv += 1;
            let rv = s.rv;
            let mut old = s
                .objects
                .get_mut(&kind)
                .and_then(|m| m.remove(&(namespace.to_string(), name.to_string())))
                .unwrap_or_else(|| panic!("no {kind:?} {namespace}/{name}"));
            let prev = old.clone();
            old["metadata"]["resourceVersion"] = json!(rv.to_string());
            (prev, old)
        };
        self.record(kind, Some(old.0), old.1, true);
    }

    /// While hidden, changes are logged (a resumed watch replays them) but
    /// not sent on open watches: as if the connection had stalled.
    pub fn set_hidden(&self, hidden: bool) {
        self.st.lock().unwrap().hidden = hidden;
    }

    /// Every request answers 500 while failing.
    pub fn set_failing(&self, fail: bool) {
        self.st.lock().unwrap().fail = fail;
    }

    /// Lists of `kind` wait while held.
    pub fn hold_lists(&self, kind: Kind, held: bool) {
        self.st.lock().unwrap().held.insert(kind, held);
    }

    /// The history of `kind` is compacted: open watches get `410 Gone`
    /// (`Expired`) and end, and so does any watch from an older
    /// resourceVersion. Clients must relist.
    pub fn expire(&self, kind: Kind) {
        let mut s = self.st.lock().unwrap();
        let rv = s.rv;
        s.compacted.insert(kind, rv + 1);
        s.watchers.retain(|w| {
            if w.kind != kind {
                return true;
            }
            let _ = w.tx.unbounded_send(Ok(expired_line()));
            false
        });
    }

    /// Open watches of `kind` break mid-stream (the connection is reset).
    pub fn drop_watches(&self, kind: Kind) {
        let mut s = self.st.lock().unwrap();
        s.watchers.retain(|w| {
            if w.kind != kind {
                return true;
            }
            let _ = w.tx.unbounded_send(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "scripted drop",
            )));
            false
        });
    }

    /// Sends a BOOKMARK at the current resourceVersion on every open watch.
    pub fn bookmark(&self) {
        let mut s = self.st.lock().unwrap();
        let rv = s.rv.to_string();
        s.watchers.retain(|w| {
            let (api_version, kind) = match w.kind {
                Kind::Services => ("v1", "Service"),
                Kind::EndpointSlices => ("discovery.k8s.io/v1", "EndpointSlice"),
                Kind::Nodes => ("v1", "Node"),
            };
            let obj = json!({"apiVersion": api_version, "kind": kind,
                             "metadata": {"resourceVersion": rv}});
            w.tx.unbounded_send(Ok(line("BOOKMARK", &obj))).is_ok()
        });
    }

    pub fn requests(&self) -> Vec<Request> {
        self.st.lock().unwrap().requests.clone()
    }

    /// Requests for `kind`: (lists, watches).
    pub fn counts(&self, kind: Kind) -> (usize, usize) {
        let r = self.requests();
        let of = r.iter().filter(|r| r.kind == Some(kind));
        let watches = of.clone().filter(|r| r.is_watch()).count();
        (of.count() - watches, watches)
    }

    /// Open watches of `kind`.
    pub fn open_watches(&self, kind: Kind) -> usize {
        let mut s = self.st.lock().unwrap();
        s.watchers.retain(|w| !w.tx.is_closed());
        s.watchers.iter().filter(|w| w.kind == kind).count()
    }
}
