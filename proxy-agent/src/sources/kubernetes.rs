//! The `kubernetes` source of desired state: kube-rs watches on Services,
//! EndpointSlices (`discovery.k8s.io/v1`) and this node's Node object.
//!
//! As kube-proxy does, Services and EndpointSlices are watched with a label
//! selector that leaves out headless services and those meant for another
//! proxy, so the API server never sends them. Each watch keeps its objects
//! as the model takes them: a Service or an EndpointSlice made compact as
//! its event arrives ([`crate::objects::CompactService`]), one copy shared
//! with the model; the Node trimmed ([`trim`]: `managedFields`, and
//! annotations the agent does not read).
//!
//! Watch errors back off and relist; a relist replaces a watch's objects
//! only once it has completed, and an error never clears them, so an API
//! server outage never removes programmed state.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

use futures::{Stream, StreamExt};
use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    api::Api,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        watcher::{self, Event},
        WatchStreamExt,
    },
    Client, Resource, ResourceExt,
};
use serde::de::DeserializeOwned;
use tokio::{sync::mpsc::UnboundedSender, task::JoinHandle};
use tracing::{debug, error, info, warn};

use crate::{
    objects::{
        Change, Kind, Object, ObjectKey, Snapshot, ANNOTATION_LAST_CHANGE_TRIGGER_TIME,
        ANNOTATION_LB_ALGORITHM, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
    },
    sources::{Source, SourceChanges, SourceError},
};

/// Errors building a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading the kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("no Kubernetes client configuration (neither in-cluster nor a kubeconfig): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    #[error("master: not a URL: {0}")]
    Master(String),
}

/// Where the API server address the agent dials came from: what a log line
/// names when the API server cannot be reached, with the setting that fixes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiServerOrigin {
    /// `--master` / `master:`.
    Master,
    /// A kubeconfig file (given, `$KUBECONFIG` or `~/.kube/config`).
    Kubeconfig,
    /// In-cluster: `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`.
    InCluster,
}

/// The API server the agent dials, and why that one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiServer {
    pub url: String,
    pub origin: ApiServerOrigin,
}

impl ApiServer {
    /// What to tell the operator when no list completed after `waited`.
    pub fn unreachable_hint(&self, waited: std::time::Duration) -> String {
        let base = format!(
            "no complete list from the API server at {} after {:.0?}",
            self.url, waited
        );
        match self.origin {
            ApiServerOrigin::InCluster => format!(
                "{base}: that address is KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT, \
                 the ClusterIP of the `kubernetes` Service, which nothing translates on a node \
                 before this agent has programmed it; give the API server's own address: \
                 set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT in the DaemonSet \
                 (deploy/api-server.yaml), or `master:` in the config (--master)"
            ),
            ApiServerOrigin::Kubeconfig => format!(
                "{base} (from the kubeconfig's server): check that address, or give the API \
                 server's own address with `master:` in the config (--master)"
            ),
            ApiServerOrigin::Master => {
                format!("{base} (from `master:` / --master): check that address")
            }
        }
    }
}

/// A client from `kubeconfig` when given, else inferred as kube-rs does: the
/// in-cluster service account inside a pod, `$KUBECONFIG` or `~/.kube/config`
/// outside. `master` replaces the server address of either (kube-proxy's
/// `--master`); with nothing else to go on, it is used without credentials.
/// Needs a Tokio runtime.
pub async fn client(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
) -> Result<(Client, ApiServer), ClientError> {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let inferred = match kubeconfig {
        Some(path) => {
            let err = |source| ClientError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let kc = Kubeconfig::read_from(path).map_err(err)?;
            Ok(
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(err)?,
            )
        }
        None => kube::Config::infer().await.map_err(ClientError::Infer),
    };
    let (config, origin) = match (inferred, master) {
        (Ok(mut c), Some(m)) => {
            c.cluster_url = m
                .parse()
                .map_err(|e| ClientError::Master(format!("{m}: {e}")))?;
            (c, ApiServerOrigin::Master)
        }
        (Err(_), Some(m)) => {
            let url = m
                .parse()
                .map_err(|e| ClientError::Master(format!("{m}: {e}")))?;
            (kube::Config::new(url), ApiServerOrigin::Master)
        }
        (Ok(c), None) if kubeconfig.is_none() && in_cluster => (c, ApiServerOrigin::InCluster),
        (Ok(c), None) => (c, ApiServerOrigin::Kubeconfig),
        (Err(e), None) => return Err(e),
    };
    let api = ApiServer {
        url: config.cluster_url.to_string(),
        origin,
    };
    Ok((Client::try_from(config)?, api))
}

/// The label selector kube-proxy puts on its Service and EndpointSlice watches.
/// Without a proxy name, objects carrying `service.kubernetes.io/service-proxy-name`
/// are left out; with one, only objects naming this proxy are watched.
pub fn label_selector(service_proxy_name: Option<&str>) -> String {
    match service_proxy_name {
        None => format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"),
        Some(name) => format!("{LABEL_SERVICE_PROXY_NAME}={name},!{LABEL_HEADLESS}"),
    }
}

/// The field selector of the Node watch: this node only.
pub fn node_field_selector(node_name: &str) -> String {
    format!("metadata.name={node_name}")
}

/// The annotations the agent reads; [`trim`] drops every other.
pub const ANNOTATIONS_READ: [&str; 2] =
    [ANNOTATION_LAST_CHANGE_TRIGGER_TIME, ANNOTATION_LB_ALGORITHM];

/// Drops what the agent never reads: `managedFields`, every annotation but
/// those it reads ([`ANNOTATIONS_READ`]: the EndpointSlice trigger time, a
/// Service's load-balancing algorithm), and the kind's own fields it never
/// reads ([`Trim`]). Both sources keep Nodes and Pods trimmed so; a Service
/// or an EndpointSlice is then made compact, which keeps less still.
pub fn trim<K: Trim>(obj: &mut K) {
    obj.managed_fields_mut().clear();
    let annotations = obj.annotations_mut();
    annotations.retain(|k, _| ANNOTATIONS_READ.contains(&k.as_str()));
    obj.trim_own();
}

/// A kind whose objects the sources keep: which of its own fields [`trim`]
/// drops.
pub trait Trim: ResourceExt {
    /// Drops the fields of this kind the agent never reads.
    fn trim_own(&mut self) {}
}

impl Trim for Service {}
impl Trim for Node {}
impl Trim for k8s_openapi::api::core::v1::Pod {}

impl Trim for EndpointSlice {
    /// An endpoint's `targetRef` (kind, namespace, name, uid of its Pod),
    /// `hostname` and `deprecatedTopology` are never read, nor any address
    /// but its first (kube-proxy's rule, the API's limit): in a cluster's
    /// slices those are most of an endpoint's heap.
    fn trim_own(&mut self) {
        for e in &mut self.endpoints {
            e.target_ref = None;
            e.hostname = None;
            e.deprecated_topology = None;
            e.addresses.truncate(1);
        }
    }
}

/// Options of the Kubernetes source.
#[derive(Clone, Debug, Default)]
pub struct KubernetesOptions {
    /// This node's name: the Node object watched.
    pub node_name: String,
    /// This proxy's `service.kubernetes.io/service-proxy-name`, if it has one.
    pub service_proxy_name: Option<String>,
    /// The API server dialled, named when it cannot be reached.
    pub api_server: Option<ApiServer>,
}

/// One watch's objects as the model takes them (Services and EndpointSlices
/// compact, as they are converted when their event arrives: the full
/// objects are never kept), and what its events named since they were last
/// taken.
#[derive(Default)]
struct WatchState {
    objects: BTreeMap<ObjectKey, Object>,
    /// A list in progress: what it listed so far. `objects` stay as they
    /// were until it is done (as kube's reflector keeps its store), so a
    /// relist that fails half-way removes nothing.
    listing: Option<BTreeMap<ObjectKey, Object>>,
    /// Keys events named since [`Reflector::changes`] last ran.
    dirty: BTreeSet<ObjectKey>,
    /// The watch listed again: what it no longer lists must be found by a
    /// comparison of everything.
    relisted: bool,
    /// The newest `resourceVersion` of an object the watch delivered (a
    /// listed one once the list is done): every event before it in the
    /// watch's order has been delivered too.
    revision: u64,
}

/// A kind the model reads, as the model takes it.
trait Watched: Trim + Sized {
    const MODEL_KIND: Kind;
    fn object(this: Self) -> Object;
}

impl Watched for Service {
    const MODEL_KIND: Kind = Kind::Service;
    fn object(this: Self) -> Object {
        Object::from(&this)
    }
}

impl Watched for EndpointSlice {
    const MODEL_KIND: Kind = Kind::EndpointSlice;
    fn object(this: Self) -> Object {
        Object::from(&this)
    }
}

impl Watched for Node {
    const MODEL_KIND: Kind = Kind::Node;
    fn object(this: Self) -> Object {
        Object::from(this)
    }
}

/// One watch: its kind, its objects, whether it has listed once, its task.
struct Reflector {
    kind: Kind,
    state: Arc<Mutex<WatchState>>,
    listed: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

impl Reflector {
    fn new<K>(
        api: Api<K>,
        config: watcher::Config,
        kind: &'static str,
        changes: UnboundedSender<()>,
    ) -> Self
    where
        K: Resource<DynamicType = ()>
            + Watched
            + Clone
            + DeserializeOwned
            + fmt::Debug
            + Send
            + Sync
            + 'static,
    {
        let listed = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(WatchState {
            relisted: true,
            ..WatchState::default()
        }));
        let stream = watcher::watcher(api, config)
            .default_backoff()
            .modify(trim::<K>);
        let task = tokio::spawn(drive(stream, kind, listed.clone(), state.clone(), changes));
        Self {
            kind: K::MODEL_KIND,
            state,
            listed,
            task: Some(task),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The changes since the last call: each object a watch event named, as
    /// the watch has it now (or gone). `None` after a relist (and the first
    /// time): then only all objects will do.
    fn changes(&self) -> Option<Vec<Change>> {
        let mut state = self.lock();
        let dirty = std::mem::take(&mut state.dirty);
        if std::mem::take(&mut state.relisted) {
            return None;
        }
        let changes = dirty
            .into_iter()
            .map(|key| match state.objects.get(&key) {
                Some(o) => Change::Applied(o.clone()),
                None => Change::Deleted(self.kind, key),
            })
            .collect();
        Some(changes)
    }

    fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }

    /// [`WatchState::revision`].
    fn revision(&self) -> u64 {
        self.lock().revision
    }

    /// Every object (shared, not copied), by namespace and name.
    fn objects(&self) -> Vec<Object> {
        self.lock().objects.values().cloned().collect()
    }
}

impl Drop for Reflector {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// The API server's message when it refused a list or watch for want of
/// a permission (403 Forbidden): it names the user, the verb, the resource
/// and its group.
fn forbidden(e: &watcher::Error) -> Option<&str> {
    let status = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s,
        watcher::Error::WatchError(s) => s,
        _ => return None,
    };
    (status.code == 403).then_some(status.message.as_str())
}

/// An object's `resourceVersion` as a number (0 if it has none or it is
/// not one: the API server's are etcd revisions, but clients must not
/// rely on that, so an opaque one only leaves the revision behind).
fn revision_of<K: Resource>(o: &K) -> u64 {
    o.meta()
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Polls a watch stream forever, keeping `state` as the watch has it: each
/// object converted as its event arrives, a list made the objects once it
/// is complete; every event that may change them is signalled. Errors are
/// logged; the backoff retries (relisting when the watch expired).
async fn drive<K, S>(
    stream: S,
    kind: &'static str,
    listed: Arc<AtomicBool>,
    state: Arc<Mutex<WatchState>>,
    changes: UnboundedSender<()>,
) where
    K: Resource<DynamicType = ()> + Watched + fmt::Debug,
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    let lock = || {
        state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let mut stream = std::pin::pin!(stream);
    let mut listing_revision = 0;
    while let Some(item) = stream.next().await {
        match item {
            Ok(Event::Init) => {
                debug!(kind, "listing");
                lock().listing = Some(BTreeMap::new());
                listing_revision = 0;
            }
            Ok(Event::InitApply(o)) => {
                listing_revision = listing_revision.max(revision_of(&o));
                let o = K::object(o);
                let key = o.key();
                lock().listing.get_or_insert_default().insert(key, o);
            }
            Ok(Event::InitDone) => {
                let first = !listed.swap(true, Ordering::AcqRel);
                info!(kind, first, "listed");
                let mut s = lock();
                s.objects = s.listing.take().unwrap_or_default();
                s.relisted = true;
                s.revision = s.revision.max(listing_revision);
                drop(s);
                let _ = changes.send(());
            }
            Ok(Event::Apply(o)) => {
                let revision = revision_of(&o);
                let o = K::object(o);
                let key = o.key();
                let mut s = lock();
                s.revision = s.revision.max(revision);
                s.objects.insert(key.clone(), o);
                s.dirty.insert(key);
                drop(s);
                let _ = changes.send(());
            }
            Ok(Event::Delete(o)) => {
                let revision = revision_of(&o);
                let key = K::object(o).key();
                let mut s = lock();
                s.revision = s.revision.max(revision);
                s.objects.remove(&key);
                s.dirty.insert(key);
                drop(s);
                let _ = changes.send(());
            }
            // The objects are kept as they are; the watcher backs off and
            // resumes (or relists when the API server says the watch
            // expired).
            Err(e) => match forbidden(&e) {
                Some(message) => error!(
                    kind,
                    "the API server refuses the agent: {message}; its ServiceAccount needs get, \
                     list and watch on Services, EndpointSlices (discovery.k8s.io) and Nodes, as \
                     the ClusterRole of deploy/clusterrole.yaml grants (retrying with backoff)"
                ),
                None => warn!(kind, error = %e, "watch error; retrying with backoff"),
            },
        }
    }
}

/// Services, EndpointSlices and this node's Node object from the API server.
pub struct KubernetesSource {
    client: Client,
    opts: KubernetesOptions,
    services: Option<Reflector>,
    slices: Option<Reflector>,
    nodes: Option<Reflector>,
    /// [`Source::revision`] of what was last taken.
    taken_revision: Option<u64>,
}

impl KubernetesSource {
    pub fn new(client: Client, opts: KubernetesOptions) -> Self {
        Self {
            client,
            opts,
            services: None,
            slices: None,
            nodes: None,
            taken_revision: None,
        }
    }

    /// The revision every watch of Services and EndpointSlices has reached,
    /// read before their changes are taken (so it never claims an event
    /// the taking missed). The Node watch, of one object, is left out: it
    /// would hold the revision back to the Node's last change.
    fn note_revision(&mut self) {
        self.taken_revision = match (&self.services, &self.slices) {
            (Some(s), Some(e)) => Some(s.revision().min(e.revision())),
            _ => None,
        };
    }
}

impl Source for KubernetesSource {
    /// Starts the three reflectors. Must be called inside a Tokio runtime.
    fn start(&mut self, changes: UnboundedSender<()>) -> Result<(), SourceError> {
        if self.opts.node_name.is_empty() {
            return Err(SourceError::Other(
                "the kubernetes source needs the node name".into(),
            ));
        }
        let labels = label_selector(self.opts.service_proxy_name.as_deref());
        let filtered = watcher::Config::default().labels(&labels);
        self.services = Some(Reflector::new::<Service>(
            Api::all(self.client.clone()),
            filtered.clone(),
            "Service",
            changes.clone(),
        ));
        self.slices = Some(Reflector::new::<EndpointSlice>(
            Api::all(self.client.clone()),
            filtered,
            "EndpointSlice",
            changes.clone(),
        ));
        self.nodes = Some(Reflector::new::<Node>(
            Api::all(self.client.clone()),
            watcher::Config::default().fields(&node_field_selector(&self.opts.node_name)),
            "Node",
            changes,
        ));
        info!(label_selector = %labels, node = %self.opts.node_name, "watching the API server");
        Ok(())
    }

    /// True once every watch has listed (it stays true through later relists,
    /// during which the stores keep their content).
    fn ready(&self) -> bool {
        self.services.as_ref().is_some_and(Reflector::listed)
            && self.slices.as_ref().is_some_and(Reflector::listed)
            && self.nodes.as_ref().is_some_and(Reflector::listed)
    }

    fn not_ready_hint(&self, waited: std::time::Duration) -> Option<String> {
        let api = self.opts.api_server.as_ref()?;
        Some(api.unreachable_hint(waited))
    }

    /// The objects as API objects, with what the model reads of them
    /// (Services and EndpointSlices are kept compact).
    fn snapshot(&mut self) -> (Snapshot, usize) {
        self.note_revision();
        let mut snapshot = Snapshot::default();
        for o in [&self.services, &self.slices, &self.nodes]
            .into_iter()
            .flatten()
            .flat_map(Reflector::objects)
        {
            match o {
                Object::Service(s) => snapshot.services.push((&*s).into()),
                Object::EndpointSlice(s) => snapshot.endpoint_slices.push((&*s).into()),
                Object::Pod(p) => snapshot.pods.push((*p).clone()),
                Object::Node(n) => snapshot.nodes.push((*n).clone()),
            }
        }
        // Objects that do not decode fail the whole watch event in kube-rs and
        // are reported (and retried) by the watcher, not here.
        (snapshot, 0)
    }

    /// The objects watch events named since the last call; everything after
    /// a relist of any kind (a relist may have dropped objects no event
    /// named).
    fn changes(&mut self) -> (SourceChanges, usize) {
        self.note_revision();
        let (Some(services), Some(slices), Some(nodes)) =
            (&self.services, &self.slices, &self.nodes)
        else {
            return (SourceChanges::Changes(Vec::new()), 0);
        };
        // Every reflector's changes are taken (and its relist flag cleared)
        // before the stores are read: an event after this point is named
        // again.
        let taken = [services.changes(), slices.changes(), nodes.changes()];
        if taken.iter().any(Option::is_none) {
            return (SourceChanges::All(self.all()), 0);
        }
        (
            SourceChanges::Changes(taken.into_iter().flatten().flatten().collect()),
            0,
        )
    }

    /// Every object of the stores (shared, not copied): the model compares
    /// them with what it holds, a pointer comparison for each unchanged one.
    fn resync(&mut self) -> (SourceChanges, usize) {
        self.note_revision();
        if let (Some(s), Some(e), Some(n)) = (&self.services, &self.slices, &self.nodes) {
            // What the watches named since is in the stores already.
            let _ = (s.changes(), e.changes(), n.changes());
        }
        (SourceChanges::All(self.all()), 0)
    }

    fn revision(&self) -> Option<u64> {
        self.taken_revision
    }
}

impl KubernetesSource {
    fn all(&self) -> Vec<Object> {
        let mut out = Vec::new();
        for r in [&self.services, &self.slices, &self.nodes]
            .into_iter()
            .flatten()
        {
            out.extend(r.objects());
        }
        out
    }
}
