//! The model kept up to date object by object ([`Incremental`]): a change of
//! a Service, an EndpointSlice or a Pod recomputes only the Services it
//! concerns, and ownership of what they claim is decided again only where
//! their claims were or are; a change of this node's Node object that
//! matters to the model (addresses, zone) recomputes every Service. What
//! changed in the [`DesiredState`] is handed on ([`Update`]), so that the
//! writer touches only those frontends.
//!
//! The result is the same as computing everything again ([`desired_state_with`]
//! is this model fed a whole snapshot at once): ownership of an address, port
//! and protocol goes to the best-ranked claim of all the Services that
//! claim it ([`ClaimRank`]), whatever order they came in, and a
//! `healthCheckNodePort` to the first Service by namespace/name that needs
//! it. The one input of history: among Services without a
//! `creationTimestamp`, the current owner of a frontend keeps it (as
//! [`ModelOptions::current_owners`] says for a computation from scratch).
//!
//! Why one file (about 1,000 lines): [`Incremental`] is one piece of state
//! whose indexes must agree after every change: the objects, each Service's
//! output, the claimants and conflicts of every frontend and
//! `healthCheckNodePort`, and the counts of local endpoints. `apply`,
//! `recompute`, `resolve` and `install` each update several of them, so they
//! stay in the file that declares them.
//!
//! [`desired_state_with`]: super::desired_state_with
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use proxy_common::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::endpoints::parse_endpoint_address;
use super::frontends::Owned;
use super::pipeline::{service_output, NodeContext, ServiceOutput};
use super::pods::service_slices_from_pods;
use super::policy::ClaimRank;
use super::services::ignored;
use super::{
    proto_name, DesiredState, Frontend, FrontendKey, HealthCheck, IpFamily, ModelOptions,
    ModelWarning, ServiceAge,
};
use crate::objects::compact::{CompactService, CompactSlice};
use crate::objects::Snapshot;
use crate::objects::{meta_key, name, namespace, Change, Kind, Object, ObjectKey};
use crate::vec_set::{repack, VecSet};

/// What one [`Incremental::apply`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Update {
    /// Frontends added, changed or removed.
    pub frontends: BTreeSet<FrontendKey>,
    /// Addresses that became local endpoints or stopped being ones.
    pub local_endpoints: BTreeSet<IpAddr>,
    /// Services computed again.
    pub services: usize,
    /// Whether anything outside the frontends changed: the node's address,
    /// the health checks or the capacity order.
    pub other: bool,
    /// Warnings of what was computed again (each Service's own, and
    /// ownership conflicts that changed).
    pub warnings: Vec<ModelWarning>,
}

impl Update {
    /// Whether the desired state is as it was.
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.local_endpoints.is_empty() && !self.other
    }
}

/// Addresses one slice places on this node and on others.
#[derive(Clone, Debug, Default)]
struct LocalSets {
    here: VecSet<IpAddr>,
    elsewhere: VecSet<IpAddr>,
}

impl LocalSets {
    fn of<'a>(slices: impl Iterator<Item = &'a CompactSlice>, node_name: &str) -> Self {
        // Collected, then sorted once: inserted one by one, a sorted vector
        // would shift its tail each time (a Service's Pod-synthesized slices
        // come here all at once, in pod-name order, their addresses in none).
        let (mut here, mut elsewhere) = (Vec::new(), Vec::new());
        let endpoints = slices.flat_map(|s| {
            let family = IpFamily::from_name(&s.address_type);
            s.endpoints.iter().map(move |e| (family, e))
        });
        for (family, e) in endpoints {
            let Some(addr) = family
                .zip(e.address.as_deref())
                .and_then(|(f, a)| parse_endpoint_address(f, a))
            else {
                continue;
            };
            match e.node_name.as_deref() {
                Some(n) if n == node_name => here.push(addr),
                Some(_) => elsewhere.push(addr),
                None => {}
            }
        }
        Self {
            here: here.into_iter().collect(),
            elsewhere: elsewhere.into_iter().collect(),
        }
    }
}

/// How many slices place each address on this node and on others.
#[derive(Default)]
struct LocalCounts {
    here: BTreeMap<IpAddr, u32>,
    elsewhere: BTreeMap<IpAddr, u32>,
}

impl LocalCounts {
    fn count(&mut self, sets: &LocalSets, add: bool, touched: &mut BTreeSet<IpAddr>) {
        for (set, counts) in [
            (&sets.here, &mut self.here),
            (&sets.elsewhere, &mut self.elsewhere),
        ] {
            for a in set {
                touched.insert(*a);
                let n = counts.entry(*a).or_insert(0);
                if add {
                    *n += 1;
                } else {
                    *n -= 1;
                    if *n == 0 {
                        counts.remove(a);
                    }
                }
            }
        }
    }

    /// An address is local when some slice places it here and none
    /// elsewhere: one Service's slice (a stale or a hostile one) must not
    /// turn another Service's remote backend into a local one, whose external
    /// traffic would then leave without the SNAT its replies need.
    fn is_local(&self, addr: &IpAddr) -> bool {
        self.here.contains_key(addr) && !self.elsewhere.contains_key(addr)
    }
}

/// A batch that computes at least this many Services again, and at least a
/// quarter of those held, repacks the model's maps ([`Incremental::repack`]).
const REPACK_AT: usize = 1_024;

/// A batch that computes at least this many Services computes them on
/// every CPU it may use, at most 4 ([`Incremental::compute`]); a smaller one
/// is not worth a thread.
const PARALLEL_AT: usize = 1_024;

/// What one Service asks for, computed from the objects alone: the local
/// endpoints of its Pod-synthesized slices, and its output, or why it is
/// ignored.
struct Computed {
    sets: LocalSets,
    output: Result<ServiceOutput, &'static str>,
}

/// The model of one node, fed object changes (see the module docs).
pub struct Incremental {
    opts: ModelOptions,
    ctx: NodeContext,
    services: BTreeMap<ObjectKey, Arc<CompactService>>,
    slices: BTreeMap<ObjectKey, Arc<CompactSlice>>,
    /// (namespace, Service name) → names of its IPv4 and IPv6 slices.
    slices_by_service: BTreeMap<ObjectKey, VecSet<Arc<str>>>,
    pods: BTreeMap<ObjectKey, Arc<Pod>>,
    nodes: BTreeMap<String, Arc<Node>>,
    /// The usable addresses on this node's external interfaces, sorted
    /// ([`Incremental::set_interface_addresses`]).
    iface_addrs: Vec<IpAddr>,
    /// Whether they changed since the node's context was computed: the next
    /// [`Incremental::apply`] computes it again.
    iface_addrs_changed: bool,
    /// Every Service's output (ignored Services have none).
    outputs: BTreeMap<ObjectKey, ServiceOutput>,
    claimants: HashMap<Owned, VecSet<ObjectKey>>,
    /// Warnings of the Services that lost an address, by address.
    conflicts: HashMap<Owned, Vec<ModelWarning>>,
    health_claimants: BTreeMap<u16, VecSet<ObjectKey>>,
    health_conflicts: BTreeMap<u16, Vec<ModelWarning>>,
    /// Local endpoints: each Service's synthesized slices' sets, and how
    /// many slices (real or synthesized) name each address. A real slice's
    /// sets are computed again from it when it goes (the same slice and node
    /// give the same sets): kept, they would cost more than the slice.
    synth_local: BTreeMap<ObjectKey, LocalSets>,
    local: LocalCounts,
    pod_warnings: BTreeMap<ObjectKey, Vec<ModelWarning>>,
    desired: DesiredState,
    /// ClusterIP frontends whose owner changed in this update, with the
    /// Services that lost and won them ([`Incremental::name_moved_aliases`]).
    moved_aliases: Vec<(FrontendKey, Vec<ObjectKey>)>,
}

impl Incremental {
    /// An empty model for `node_name`: no objects, nothing desired.
    pub fn new(node_name: &str, opts: ModelOptions) -> Self {
        let ctx = NodeContext::new(node_name, None, &[], &opts);
        Self {
            opts,
            ctx,
            services: BTreeMap::new(),
            slices: BTreeMap::new(),
            slices_by_service: BTreeMap::new(),
            pods: BTreeMap::new(),
            nodes: BTreeMap::new(),
            iface_addrs: Vec::new(),
            iface_addrs_changed: false,
            outputs: BTreeMap::new(),
            claimants: HashMap::new(),
            conflicts: HashMap::new(),
            health_claimants: BTreeMap::new(),
            health_conflicts: BTreeMap::new(),
            synth_local: BTreeMap::new(),
            local: LocalCounts::default(),
            pod_warnings: BTreeMap::new(),
            desired: DesiredState::default(),
            moved_aliases: Vec::new(),
        }
    }

    /// The desired state as of the last change applied.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// The Node object named `name`, if the model holds it.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name).map(|n| &**n)
    }

    /// Sets the addresses configured on this node's external interfaces
    /// now: with its `InternalIP`s, the candidates of its NodePort
    /// addresses (see [`super::NodePortAddresses`]), and own addresses
    /// refused as externalIPs. Addresses that can never be frontends
    /// (loopback, link-local: [`super::forbidden_address`]) are left out.
    /// The next [`Incremental::apply`] (or `replace`) computes every
    /// Service again if the set changed, as after a change of the Node;
    /// returns whether it changed.
    pub fn set_interface_addresses(&mut self, addrs: impl IntoIterator<Item = IpAddr>) -> bool {
        let mut addrs: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|a| super::forbidden_address(*a).is_none())
            .collect();
        addrs.sort();
        addrs.dedup();
        if addrs == self.iface_addrs {
            return false;
        }
        self.iface_addrs = addrs;
        self.iface_addrs_changed = true;
        true
    }

    /// The objects the model holds (shared, not copied).
    pub fn objects(&self) -> Vec<Object> {
        let services = self.services.values().cloned().map(Object::Service);
        let slices = self.slices.values().cloned().map(Object::EndpointSlice);
        let pods = self.pods.values().cloned().map(Object::Pod);
        let nodes = self.nodes.values().cloned().map(Object::Node);
        services.chain(slices).chain(pods).chain(nodes).collect()
    }

    /// Every warning that holds now: Pods', the node's, each Service's
    /// (namespace/name order) and the ownership conflicts'.
    pub fn warnings(&self) -> Vec<ModelWarning> {
        let mut out: Vec<ModelWarning> = self.pod_warnings.values().flatten().cloned().collect();
        let firsts = IpFamily::ALL.map(|f| {
            self.outputs
                .iter()
                .find_map(|(k, o)| o.first_node_port[f.index()].map(|p| (k.clone(), p)))
        });
        out.extend(self.node_problems(&firsts));
        for o in self.outputs.values() {
            out.extend(o.warnings.iter().cloned());
        }
        let mut conflicts: Vec<(&Owned, &Vec<ModelWarning>)> = self.conflicts.iter().collect();
        conflicts.sort_by_key(|(o, _)| **o);
        for (_, w) in conflicts {
            out.extend(w.iter().cloned());
        }
        out.extend(self.health_conflicts.values().flatten().cloned());
        out
    }

    /// Makes the model's objects those of `snapshot`: what is not in it is
    /// deleted, what is applied (unchanged objects cost a comparison). The
    /// first of two objects with one key is kept.
    pub fn replace(&mut self, snapshot: Snapshot) -> Update {
        let objects = snapshot
            .services
            .iter()
            .map(Object::from)
            .chain(snapshot.endpoint_slices.iter().map(Object::from))
            .chain(snapshot.pods.into_iter().map(Object::from))
            .chain(snapshot.nodes.into_iter().map(Object::from));
        self.replace_objects(objects)
    }

    /// [`Incremental::replace`] with shared objects: an object the model
    /// holds already (the same `Arc`) costs a pointer comparison.
    pub fn replace_objects(&mut self, objects: impl IntoIterator<Item = Object>) -> Update {
        let mut changes = Vec::new();
        let mut keep = |kind: Kind, keys: BTreeSet<ObjectKey>, held: Vec<ObjectKey>| {
            for k in held.into_iter().filter(|k| !keys.contains(k)) {
                changes.push(Change::Deleted(kind, k));
            }
        };
        let mut seen = BTreeSet::new();
        let mut applied = Vec::new();
        let mut keys: BTreeMap<Kind, BTreeSet<ObjectKey>> = BTreeMap::new();
        for o in objects {
            let kind = o.kind();
            let key = o.key();
            if seen.insert((kind, key.clone())) {
                keys.entry(kind).or_default().insert(key);
                applied.push(Change::Applied(o));
            }
        }
        let mut take = |kind: Kind| keys.remove(&kind).unwrap_or_default();
        keep(
            Kind::Service,
            take(Kind::Service),
            self.services.keys().cloned().collect(),
        );
        keep(
            Kind::EndpointSlice,
            take(Kind::EndpointSlice),
            self.slices.keys().cloned().collect(),
        );
        keep(
            Kind::Pod,
            take(Kind::Pod),
            self.pods.keys().cloned().collect(),
        );
        keep(
            Kind::Node,
            take(Kind::Node),
            self.nodes
                .keys()
                .map(|n| ("".into(), n.as_str().into()))
                .collect(),
        );
        changes.extend(applied);
        self.apply(changes)
    }

    /// Applies `changes` in order and computes again what they concern.
    pub fn apply(&mut self, changes: impl IntoIterator<Item = Change>) -> Update {
        let mut up = Update::default();
        let mut dirty: BTreeSet<ObjectKey> = BTreeSet::new();
        let mut touched_local: BTreeSet<IpAddr> = BTreeSet::new();
        let mut node_changed = std::mem::take(&mut self.iface_addrs_changed);
        // Services added, removed or whose creationTimestamp changed.
        let mut aged: BTreeSet<ObjectKey> = BTreeSet::new();
        for change in changes {
            match change {
                Change::Applied(Object::Service(svc)) => {
                    let key = svc.key();
                    let old = self.services.get(&key);
                    if same(old, &svc) {
                        continue;
                    }
                    if old.is_none_or(|o| o.creation_timestamp != svc.creation_timestamp) {
                        aged.insert(key.clone());
                    }
                    self.services.insert(key.clone(), svc);
                    dirty.insert(key);
                }
                Change::Deleted(Kind::Service, key) => {
                    if self.services.remove(&key).is_some() {
                        aged.insert(key.clone());
                        dirty.insert(key);
                    }
                }
                Change::Applied(Object::EndpointSlice(slice)) => {
                    let key = slice.key();
                    if same(self.slices.get(&key), &slice) {
                        continue;
                    }
                    self.remove_slice(&key, &mut dirty, &mut touched_local);
                    self.insert_slice(key, slice, &mut dirty, &mut touched_local);
                }
                Change::Deleted(Kind::EndpointSlice, key) => {
                    self.remove_slice(&key, &mut dirty, &mut touched_local);
                }
                Change::Applied(Object::Pod(pod)) => {
                    let key = meta_key(&pod.metadata);
                    if same(self.pods.get(&key), &pod) {
                        continue;
                    }
                    if let Some(old) = self.pods.remove(&key) {
                        self.services_selecting(&old, &mut dirty);
                    }
                    self.services_selecting(&pod, &mut dirty);
                    match pod_warnings(&pod) {
                        w if w.is_empty() => {
                            self.pod_warnings.remove(&key);
                        }
                        w => {
                            up.warnings.extend(w.iter().cloned());
                            self.pod_warnings.insert(key.clone(), w);
                        }
                    }
                    self.pods.insert(key, pod);
                }
                Change::Deleted(Kind::Pod, key) => {
                    if let Some(old) = self.pods.remove(&key) {
                        self.services_selecting(&old, &mut dirty);
                        self.pod_warnings.remove(&key);
                    }
                }
                Change::Applied(Object::Node(node)) => {
                    let n = name(&node.metadata).to_string();
                    if same(self.nodes.get(&n), &node) {
                        continue;
                    }
                    node_changed |= n == self.ctx.name;
                    self.nodes.insert(n, node);
                }
                Change::Deleted(Kind::Node, (_, n)) => {
                    if self.nodes.remove(&*n).is_some() {
                        node_changed |= *n == *self.ctx.name;
                    }
                }
            }
        }
        if node_changed {
            let ctx = NodeContext::new(
                &self.ctx.name,
                self.node(&self.ctx.name),
                &self.iface_addrs,
                &self.opts,
            );
            if ctx != self.ctx {
                self.ctx = ctx;
                dirty.extend(self.services.keys().cloned());
                dirty.extend(self.outputs.keys().cloned());
                if self.desired.node_addr != self.ctx.node_addr
                    || self.desired.node_addr6 != self.ctx.node_addr6
                {
                    self.desired.node_addr = self.ctx.node_addr;
                    self.desired.node_addr6 = self.ctx.node_addr6;
                    up.other = true;
                }
            }
        }
        // Many Services computed again (a start, a Node change): the maps
        // they filled are repacked below. A resync that changed nothing
        // computes none.
        let repack =
            dirty.len() >= REPACK_AT && dirty.len().saturating_mul(4) >= self.services.len();
        let node_problem_named = self.recompute(dirty, &mut up, &mut touched_local);
        up.warnings.extend(self.node_problems(&node_problem_named));
        for addr in touched_local {
            let local = self.local.is_local(&addr);
            let changed = if local {
                self.desired.local_endpoints.insert(addr)
            } else {
                self.desired.local_endpoints.remove(&addr)
            };
            if changed {
                up.local_endpoints.insert(addr);
            }
        }
        for key in aged {
            let id = format!("{}/{}", key.0, key.1);
            let age = self
                .services
                .get(&key)
                .map(|s| ServiceAge(s.creation_timestamp));
            let before = match age {
                Some(age) => self.desired.service_order.insert(id, age),
                None => self.desired.service_order.remove(&id),
            };
            up.other |= before != age;
        }
        if repack {
            self.repack();
        }
        up
    }

    /// Rebuilds the maps that grow with the cluster with full nodes. A
    /// `BTreeMap` filled in key order (a start: every object at once) keeps
    /// its nodes about half full; built from a sorted list it fills them.
    /// After a batch this large, the rebuild costs less than the batch did.
    /// The maps are independent: two CPUs rebuild them in two groups.
    fn repack(&mut self) {
        let (outputs, desired) = (&mut self.outputs, &mut self.desired);
        crate::parallel::join(
            || {
                repack(outputs);
                repack(&mut desired.frontends);
                repack(&mut desired.service_order);
            },
            || {
                repack(&mut self.services);
                repack(&mut self.slices);
                repack(&mut self.slices_by_service);
                repack(&mut self.local.here);
                repack(&mut self.local.elsewhere);
            },
        );
    }

    /// Services selecting `pod` (their synthesized slices change with it).
    fn services_selecting(&self, pod: &Pod, dirty: &mut BTreeSet<ObjectKey>) {
        let ns = namespace(&pod.metadata);
        let labels = pod.metadata.labels.as_ref();
        let from: ObjectKey = (ns.into(), "".into());
        for (k, svc) in self.services.range(from..).take_while(|(k, _)| &*k.0 == ns) {
            let selects = svc
                .spec
                .as_ref()
                .map(|s| &s.selector)
                .filter(|s| !s.is_empty())
                .is_some_and(|sel| {
                    sel.iter().all(|(k, v)| {
                        labels.and_then(|l| l.get(&**k)).map(String::as_str) == Some(&**v)
                    })
                });
            if selects {
                dirty.insert(k.clone());
            }
        }
    }

    fn remove_slice(
        &mut self,
        key: &ObjectKey,
        dirty: &mut BTreeSet<ObjectKey>,
        touched: &mut BTreeSet<IpAddr>,
    ) {
        let Some(old) = self.slices.remove(key) else {
            return;
        };
        if &*old.address_type != "FQDN" {
            let sets = LocalSets::of(std::iter::once(&*old), &self.ctx.name);
            self.local.count(&sets, false, touched);
        }
        if let Some(svc) = slice_service(&old) {
            let group = (key.0.clone(), svc.clone());
            if let Some(names) = self.slices_by_service.get_mut(&group) {
                names.remove(&key.1);
                if names.is_empty() {
                    self.slices_by_service.remove(&group);
                }
            }
            dirty.insert(group);
        }
    }

    fn insert_slice(
        &mut self,
        key: ObjectKey,
        slice: Arc<CompactSlice>,
        dirty: &mut BTreeSet<ObjectKey>,
        touched: &mut BTreeSet<IpAddr>,
    ) {
        // Slices of either family feed that family's frontends; FQDN ones
        // are ignored, as kube-proxy does. One of a type the API does not
        // have reaches its Service's step, which warns about it.
        if &*slice.address_type != "FQDN" {
            let sets = LocalSets::of(std::iter::once(&*slice), &self.ctx.name);
            self.local.count(&sets, true, touched);
            if let Some(svc) = slice_service(&slice) {
                let group = (key.0.clone(), svc.clone());
                self.slices_by_service
                    .entry(group.clone())
                    .or_default()
                    .insert(key.1.clone());
                dirty.insert(group);
            }
        }
        self.slices.insert(key, slice);
    }

    /// Computes the `dirty` Services again and decides again who owns what
    /// they claimed or claim. Returns, per family, the first of them
    /// (namespace/name) with a nodePort of that family, for the node's
    /// problem if it has one.
    fn recompute(
        &mut self,
        dirty: BTreeSet<ObjectKey>,
        up: &mut Update,
        touched_local: &mut BTreeSet<IpAddr>,
    ) -> FirstNodePorts {
        let mut owned_touched: BTreeSet<Owned> = BTreeSet::new();
        let mut ports_touched: BTreeSet<u16> = BTreeSet::new();
        let mut first_node_port: FirstNodePorts = Default::default();
        // What the dirty Services claimed and synthesized goes first (sets
        // and counts: the order of removals and additions does not matter).
        for key in &dirty {
            if let Some(old) = self.outputs.remove(key) {
                for owned in old.claims.keys() {
                    if let Some(c) = self.claimants.get_mut(owned) {
                        c.remove(key);
                        if c.is_empty() {
                            self.claimants.remove(owned);
                        }
                    }
                    owned_touched.insert(*owned);
                }
                if let Some((port, _)) = old.health_check {
                    if let Some(c) = self.health_claimants.get_mut(&port) {
                        c.remove(key);
                        if c.is_empty() {
                            self.health_claimants.remove(&port);
                        }
                    }
                    ports_touched.insert(port);
                }
            }
            if let Some(sets) = self.synth_local.remove(key) {
                self.local.count(&sets, false, touched_local);
            }
        }
        // Then each one's output, computed from the objects alone, then
        // recorded in key order.
        let dirty: Vec<ObjectKey> = dirty.into_iter().collect();
        let computed = self.compute(&dirty);
        for (key, computed) in dirty.into_iter().zip(computed) {
            let Some(Computed { sets, output }) = computed else {
                continue;
            };
            if !sets.here.is_empty() || !sets.elsewhere.is_empty() {
                self.local.count(&sets, true, touched_local);
                self.synth_local.insert(key.clone(), sets);
            }
            up.services += 1;
            let out = match output {
                Ok(out) => out,
                Err(why) => {
                    tracing::trace!(service = %format!("{}/{}", key.0, key.1), why, "model: service ignored");
                    continue;
                }
            };
            up.warnings.extend(out.warnings.iter().cloned());
            for (first, p) in first_node_port.iter_mut().zip(out.first_node_port) {
                if let (None, Some(p)) = (&first, p) {
                    *first = Some((key.clone(), p));
                }
            }
            for owned in out.claims.keys() {
                self.claimants
                    .entry(*owned)
                    .or_default()
                    .insert(key.clone());
                owned_touched.insert(*owned);
            }
            if let Some((port, _)) = out.health_check {
                self.health_claimants
                    .entry(port)
                    .or_default()
                    .insert(key.clone());
                ports_touched.insert(port);
            }
            self.outputs.insert(key, out);
        }
        for owned in owned_touched {
            self.resolve(owned, up);
        }
        self.name_moved_aliases(up);
        for port in ports_touched {
            self.resolve_health_check(port, up);
        }
        first_node_port
    }

    /// What each Service of `keys` asks for now (`None`: the Service is
    /// gone), from the objects the model holds alone, in the order of
    /// `keys`. A batch of [`PARALLEL_AT`] Services or more (a start, a Node
    /// change) is computed on every CPU, in contiguous parts.
    fn compute(&self, keys: &[ObjectKey]) -> Vec<Option<Computed>> {
        let threads = crate::parallel::threads();
        if threads < 2 || keys.len() < PARALLEL_AT {
            return keys.iter().map(|k| self.compute_one(k)).collect();
        }
        let parts: Vec<_> = keys
            .chunks(keys.len().div_ceil(threads))
            .map(|part| move || part.iter().map(|k| self.compute_one(k)).collect::<Vec<_>>())
            .collect();
        crate::parallel::map_parts(parts)
            .into_iter()
            .flatten()
            .collect()
    }

    /// [`Incremental::compute`] for one Service.
    fn compute_one(&self, key: &ObjectKey) -> Option<Computed> {
        let svc = self.services.get(key)?;
        let mut synthesized = Vec::new();
        if !self.pods.is_empty() {
            let from: ObjectKey = (key.0.clone(), "".into());
            let pods = self
                .pods
                .range(from..)
                .take_while(|(k, _)| k.0 == key.0)
                .map(|(_, p)| &**p);
            service_slices_from_pods(svc, pods, &mut synthesized);
        }
        let synthesized: Vec<CompactSlice> = synthesized.iter().map(CompactSlice::from).collect();
        let sets = LocalSets::of(synthesized.iter(), &self.ctx.name);
        if let Some(why) = ignored(svc, &self.opts) {
            return Some(Computed {
                sets,
                output: Err(why),
            });
        }
        let mut slices: Vec<&CompactSlice> = self
            .slices_by_service
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|n| self.slices.get(&(key.0.clone(), n.clone())).map(|s| &**s))
            .chain(synthesized.iter())
            .collect();
        // Stable: a real slice before a synthesized one of the same name.
        slices.sort_by(|a, b| a.name.cmp(&b.name));
        let output = Ok(service_output(svc, &slices, &self.ctx, &self.opts));
        Some(Computed { sets, output })
    }

    /// Decides who owns `owned` among the Services claiming it, and makes
    /// its frontends the owner's: moved into the desired state, and those of
    /// the claim that owned it before moved back to that claim.
    fn resolve(&mut self, owned: Owned, up: &mut Update) {
        let (addr, port, proto) = owned;
        let keys = [SCOPE_INTERNAL, SCOPE_EXTERNAL].map(|scope| FrontendKey {
            addr,
            port,
            proto,
            scope,
        });
        let mut best: Option<(ClaimRank, &ObjectKey)> = None;
        let mut ranks = Vec::new();
        // The claim whose frontends the desired state holds, if it is
        // still there (a Service computed again has new claims).
        let mut previous: Option<&ObjectKey> = None;
        for k in self.claimants.get(&owned).into_iter().flatten() {
            let (Some(out), Some(svc)) = (self.outputs.get(k), self.services.get(k)) else {
                continue;
            };
            let Some(claims) = out.claims.get(&owned) else {
                continue;
            };
            if claims.installed != 0 {
                previous = Some(k);
            }
            let id = format!("{}/{}", k.0, k.1);
            let current_owner = self
                .desired
                .frontends
                .get(&claims.first_key)
                .is_some_and(|f| *f.service == *id)
                || self.opts.current_owners.get(&claims.first_key) == Some(&id);
            let rank = ClaimRank {
                cluster_ip: claims.cluster_ip,
                created: svc.creation_timestamp,
                current_owner,
                service: id,
            };
            if best
                .as_ref()
                .is_none_or(|(b, _)| rank.cmp_claim(b) == std::cmp::Ordering::Less)
            {
                best = Some((rank.clone(), k));
            }
            ranks.push(rank);
        }
        let mut warnings = Vec::new();
        if let Some((winner, _)) = &best {
            for loser in ranks.iter().filter(|r| r.service != winner.service) {
                warnings.push(ModelWarning {
                    object: format!("Service {}", loser.service),
                    message: format!(
                        "frontend {addr}:{port}/{} also claimed by service {} ({}); skipped",
                        proto_name(proto),
                        winner.service,
                        winner.why_wins(loser)
                    ),
                });
            }
        }
        let best = best.map(|(_, k)| k.clone());
        let previous = previous.cloned();
        // The owner stays and its claims are those installed: its frontends
        // are the desired state's already.
        if best.is_none() || best != previous {
            self.install(owned, keys, previous, best, up);
        }
        if warnings.is_empty() {
            self.conflicts.remove(&owned);
        } else if self.conflicts.get(&owned) != Some(&warnings) {
            up.warnings.extend(warnings.iter().cloned());
            self.conflicts.insert(owned, warnings);
        }
    }

    /// Makes the frontends at `keys` (one `owned` address, both scopes)
    /// those of `winner`'s claim, moved out of it into the desired state;
    /// those of `previous`'s claim, if it had them, go back to it. Names
    /// every key whose frontend changed in `up`.
    fn install(
        &mut self,
        owned: Owned,
        keys: [FrontendKey; 2],
        previous: Option<ObjectKey>,
        winner: Option<ObjectKey>,
        up: &mut Update,
    ) {
        let before = keys.map(|k| self.desired.frontends.remove(&k));
        if let Some(c) = previous
            .as_ref()
            .and_then(|k| self.outputs.get_mut(k)?.claims.get_mut(&owned))
        {
            for (key, fe) in keys.iter().zip(&before) {
                if c.installed & (1 << key.scope) != 0 {
                    if let Some(fe) = fe {
                        c.frontends.push((*key, fe.clone()));
                    }
                }
            }
            c.installed = 0;
        }
        let mut wanted: [Option<Frontend>; 2] = [None, None];
        if let Some(c) = winner
            .as_ref()
            .and_then(|k| self.outputs.get_mut(k)?.claims.get_mut(&owned))
        {
            for (key, fe) in std::mem::take(&mut c.frontends) {
                if let Some(i) = keys.iter().position(|k| *k == key) {
                    c.installed |= 1 << key.scope;
                    wanted[i] = Some(fe);
                }
            }
        }
        let owned_by = before[0].as_ref().map(|f| f.service.clone());
        for ((key, before), wanted) in keys.into_iter().zip(before).zip(wanted) {
            if before != wanted {
                up.frontends.insert(key);
            }
            if let Some(fe) = wanted {
                self.desired.frontends.insert(key, fe);
            }
        }
        // A ClusterIP frontend whose owner changed: the frontends naming it
        // as their host alias are named once every address is resolved.
        // Only an owner change: a frontend that just changed (its backends)
        // keeps the aliases naming it, and such changes are the common ones.
        let owner_now = self.desired.frontends.get(&keys[0]).map(|f| &f.service);
        if owned_by.as_ref() != owner_now {
            // Its owners by name: a Service computed again (all of them,
            // after a change of the Node) has no claim installed, so
            // `previous` does not name the one that owned it.
            let owner = |service: Option<&Arc<str>>| {
                service
                    .and_then(|s| s.split_once('/'))
                    .map(|(ns, name)| (Arc::from(ns), Arc::from(name)))
            };
            let services = [owner(owned_by.as_ref()), owner(owner_now)];
            self.moved_aliases
                .push((keys[0], services.into_iter().flatten().collect()));
        }
    }

    /// Names in `up` the frontends of the Services that won or lost a
    /// ClusterIP frontend ([`Incremental::install`]) which name it as their
    /// host alias: the writer names it in their slot 0 only while their own
    /// Service owns it (one Service's host UDP is never aimed at another's
    /// ClusterIP), so they are written again.
    fn name_moved_aliases(&mut self, up: &mut Update) {
        for (alias, services) in std::mem::take(&mut self.moved_aliases) {
            for k in &services {
                let Some(out) = self.outputs.get(k) else {
                    continue;
                };
                for (addr, port, proto) in out.claims.keys() {
                    for scope in [SCOPE_INTERNAL, SCOPE_EXTERNAL] {
                        let key = FrontendKey {
                            addr: *addr,
                            port: *port,
                            proto: *proto,
                            scope,
                        };
                        if self
                            .desired
                            .frontends
                            .get(&key)
                            .is_some_and(|f| f.host_alias == Some(alias))
                        {
                            up.frontends.insert(key);
                        }
                    }
                }
            }
        }
    }

    /// The first Service by namespace/name that needs `port` has it.
    fn resolve_health_check(&mut self, port: u16, up: &mut Update) {
        let claimants = self.health_claimants.get(&port);
        let winner = claimants.and_then(|c| c.iter().next());
        let now = winner.and_then(|k| {
            let (_, local) = self.outputs.get(k)?.health_check?;
            let local = local as usize;
            Some(HealthCheck {
                service: format!("{}/{}", k.0, k.1),
                local_endpoints: local,
            })
        });
        let warnings: Vec<ModelWarning> = claimants
            .into_iter()
            .flatten()
            .skip(1)
            .zip(std::iter::repeat(now.as_ref()))
            .filter_map(|(k, w)| {
                Some(ModelWarning {
                    object: format!("Service {}/{}", k.0, k.1),
                    message: format!(
                        "healthCheckNodePort {port} already belongs to service {}; skipped",
                        w?.service
                    ),
                })
            })
            .collect();
        if self.desired.health_checks.get(&port) != now.as_ref() {
            up.other = true;
            match now {
                Some(hc) => self.desired.health_checks.insert(port, hc),
                None => self.desired.health_checks.remove(&port),
            };
        }
        if warnings.is_empty() {
            self.health_conflicts.remove(&port);
        } else if self.health_conflicts.get(&port) != Some(&warnings) {
            up.warnings.extend(warnings.iter().cloned());
            self.health_conflicts.insert(port, warnings);
        }
    }
}

/// Whether `new` is the object the model holds (the same `Arc`, or equal).
fn same<T: PartialEq>(held: Option<&Arc<T>>, new: &Arc<T>) -> bool {
    held.is_some_and(|o| Arc::ptr_eq(o, new) || **o == **new)
}

/// The Service a slice belongs to (its `kubernetes.io/service-name` label).
fn slice_service(slice: &CompactSlice) -> Option<&Arc<str>> {
    slice.service_name.as_ref()
}

/// Per family ([`IpFamily::index`]), the first Service with a nodePort of
/// that family, and the port.
type FirstNodePorts = [Option<(ObjectKey, u16)>; 2];

impl Incremental {
    /// Why the node serves no NodePort of a family some Service has one of:
    /// one warning without a Node object, else one per family the node has
    /// no address of (not an error: the other family is served).
    fn node_problems(&self, firsts: &FirstNodePorts) -> Vec<ModelWarning> {
        let object = format!("Node {}", self.ctx.name);
        if self.ctx.no_node {
            let first = firsts.iter().flatten().min();
            return first
                .map(|(k, p)| ModelWarning {
                    object,
                    message: format!(
                        "no Node object for this node: no NodePort frontends on this node (first: {}/{} port {p})",
                        k.0, k.1
                    ),
                })
                .into_iter()
                .collect();
        }
        IpFamily::ALL
            .into_iter()
            .filter_map(|f| {
                let why = self.ctx.problems[f.index()]?;
                let (k, p) = firsts[f.index()].as_ref()?;
                // The IPv4 wording predates dual-stack.
                let what = match f {
                    IpFamily::V4 => "NodePort",
                    IpFamily::V6 => "IPv6 NodePort",
                };
                Some(ModelWarning {
                    object: object.clone(),
                    message: format!(
                        "{why}: no {what} frontends on this node (first: {}/{} port {p})",
                        k.0, k.1
                    ),
                })
            })
            .collect()
    }
}

/// A Pod address that is no IP at all would be skipped silently otherwise.
fn pod_warnings(pod: &Pod) -> Vec<ModelWarning> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let ips = status
        .pod_ip
        .iter()
        .chain(status.pod_ips.iter().flatten().map(|p| &p.ip));
    ips.filter(|ip| !ip.is_empty() && ip.parse::<std::net::IpAddr>().is_err())
        .map(|ip| ModelWarning {
            object: format!("Pod {}/{}", namespace(&pod.metadata), name(&pod.metadata)),
            message: format!("invalid pod IP {ip:?}; the pod is not an endpoint"),
        })
        .collect()
}
