// Swagger UI over the server's openapi.json (api/playground.py). The key, where the server
// needs one, goes into the "Authorize" dialog: kept in this page only (persistAuthorization off).
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: new URL("openapi.json", document.baseURI).href,
    dom_id: "#swagger-ui",
    deepLinking: true,
    persistAuthorization: false,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
