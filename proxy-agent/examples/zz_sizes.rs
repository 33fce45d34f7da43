fn main() {
    use k8s_openapi::api::core::v1::*;
    use k8s_openapi::api::discovery::v1::*;
    println!("Service {}", std::mem::size_of::<Service>());
    println!(
        "ObjectMeta {}",
        std::mem::size_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>()
    );
    println!("ServiceSpec {}", std::mem::size_of::<ServiceSpec>());
    println!("ServicePort {}", std::mem::size_of::<ServicePort>());
    println!("EndpointSlice {}", std::mem::size_of::<EndpointSlice>());
    println!("Endpoint {}", std::mem::size_of::<Endpoint>());
    println!(
        "Frontend {}",
        std::mem::size_of::<proxy_agent::model::Frontend>()
    );
    println!(
        "FrontendKey {}",
        std::mem::size_of::<proxy_agent::model::FrontendKey>()
    );
}
